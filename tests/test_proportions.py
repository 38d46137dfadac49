"""Accuracy intervals on their scale: Wilson for a mean, Tango's paired score interval for a difference, MOVER
over tasks, with their coverage computed exactly (every outcome enumerated, weighted by its probability)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binom, multinomial

from ripplekv.analysis import inference, proportions

N = 12


def paired_outcomes(n: int = N) -> np.ndarray:
    """Every 2x2 table (both right, first only, second only, neither) of n paired samples, [tables, 4]."""
    return np.array([(a, b, c, n - a - b - c) for a in range(n + 1) for b in range(n + 1 - a)
                     for c in range(n + 1 - a - b)])


def test_wilson_matches_its_closed_form_and_stays_in_0_1():
    low, high = proportions.wilson(10, 12)
    z = 1.959963984540054
    for bound in (low, high):  # the score test's boundary: |p_hat - p| = z sqrt(p (1 - p) / n)
        assert abs(10 / 12 - bound) == pytest.approx(z * np.sqrt(bound * (1 - bound) / 12))
    assert 0.5 < low < 10 / 12 < high < 1
    assert proportions.wilson(0, 12)[0] == 0 and proportions.wilson(12, 12)[1] == 1


def test_wilson_covers_at_n_12_computed_exactly():
    k = np.arange(N + 1)
    low, high = proportions.wilson(k, N)
    coverage = [binom.pmf(k, N, p)[(low <= p) & (p <= high)].sum() for p in np.linspace(0.02, 0.98, 49)]
    assert np.mean(coverage) >= 0.945 and min(coverage) >= 0.89  # Wilson's known dips near the ends


def test_tango_paired_interval_covers_at_n_12_computed_exactly():
    tables = paired_outcomes()
    _, low, high = proportions.tango_paired(*tables.T)
    coverage = []
    for truth in np.random.default_rng(0).dirichlet(np.ones(4), size=60):
        difference = truth[1] - truth[2]
        covered = (low - 1e-9 <= difference) & (difference <= high + 1e-9)
        coverage.append(multinomial.pmf(tables, N, truth)[covered].sum())
    assert np.mean(coverage) >= 0.95 and min(coverage) >= 0.93


def test_tango_never_leaves_the_scale_nor_collapses():
    tables = paired_outcomes()
    point, low, high = proportions.tango_paired(*tables.T)
    assert (low >= -1).all() and (high <= 1).all() and (low <= point + 1e-12).all() and (point <= high + 1e-12).all()
    # No discordant pair: not a zero-width interval but about the rule of three, symmetric.
    _, low, high = proportions.tango_paired(5, 0, 0, 7)
    assert high == pytest.approx(3.841458820694124 / (N + 3.841458820694124), rel=1e-6) and low == pytest.approx(-high)
    # 10 of 12 against 0 of 12 (the Gemma row the t interval put at +83.33 [+40.49, +126.18]).
    point, low, high = proportions.tango_paired(0, 10, 0, 2)
    assert point == pytest.approx(10 / 12) and 0.3 < low < point < high < 1


def test_mover_over_tasks_is_the_task_interval_for_one_task_and_stays_on_the_scale():
    right = np.array([[100.0] * 10 + [0.0] * 2])
    point, low, high = proportions.accuracy_interval(right, np.zeros(12, dtype=int))
    assert point[0] == pytest.approx(100 * 10 / 12)
    assert (low[0], high[0]) == pytest.approx(tuple(100 * x for x in proportions.wilson(10, 12)))
    tasks = np.repeat([0, 1], 6)
    all_right = np.full((1, 12), 100.0)
    point, low, high = proportions.accuracy_interval(all_right, tasks)
    assert point[0] == 100 and high[0] == 100 and 50 < low[0] < 100
    first, second = np.full((1, 12), 100.0), np.zeros((1, 12))
    point, low, high = proportions.paired_accuracy_interval(first, second, tasks)
    assert point[0] == 100 and high[0] == 100 and 0 < low[0] < 100


def test_mover_over_two_tasks_covers_computed_exactly():
    tables = paired_outcomes(6)
    delta, low, high = proportions.tango_paired(*tables.T)
    below, above = (delta - low) / 2, (high - delta) / 2
    point = (delta[:, None] + delta[None, :]) / 2
    lower = point - np.hypot(below[:, None], below[None, :])
    upper = point + np.hypot(above[:, None], above[None, :])
    coverage = []
    for one, two in np.random.default_rng(1).dirichlet(np.ones(4), size=(20, 2)):
        truth = (one[1] - one[2] + two[1] - two[2]) / 2
        weight = multinomial.pmf(tables, 6, one)[:, None] * multinomial.pmf(tables, 6, two)[None, :]
        coverage.append(weight[(lower - 1e-9 <= truth) & (truth <= upper + 1e-9)].sum())
    assert np.mean(coverage) >= 0.95 and min(coverage) >= 0.93


def test_accuracy_tasks_are_those_scored_0_or_1_everywhere():
    frame = pd.DataFrame({"task": ["niah", "niah", "qa", "qa", "multi"], "score": [1.0, 0.0, 1.0, 0.5, 0.0]})
    assert proportions.accuracy_tasks(frame) == {"niah", "multi"}


def test_a_mixed_average_keeps_its_t_interval_cut_to_the_scale():
    values = np.array([[100.0, 100.0, 100.0, 90.0, 100.0, 100.0]])  # task 1 is a fraction: not an accuracy
    samples = inference.Samples(values, np.array([0, 0, 0, 1, 1, 1]), [], np.array([True, False]), (0.0, 100.0))
    low, high = inference.mean_interval(samples)
    estimate = inference.t_interval(values, samples.tasks)
    assert estimate.high[0] > 100 and high[0] == 100 and low[0] == pytest.approx(estimate.low[0])
