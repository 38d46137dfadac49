"""The paired, task-stratified bootstrap (rank probabilities and rank intervals): pairing, shrinking spread, seeds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis import stats


def long_frame(scores: dict[str, np.ndarray], tasks: int = 1) -> pd.DataFrame:
    """Lines (task, id, key, score, kl) from per-key arrays [tasks * n]; samples split evenly over tasks."""
    rows = []
    for key, values in scores.items():
        n = len(values) // tasks
        for j, value in enumerate(values):
            rows.append({"task": f"t{j // n}", "id": f"s{j % n:03d}", "key": key, "score": value, "kl": 1 - value})
    return pd.DataFrame(rows)


def paired(frame: pd.DataFrame, keys: list[str], seed: int = 0, resamples: int = 2000):
    boot = stats.Bootstrap.draw(frame, resamples, seed)
    point, draws = boot.replicates(frame, "score", keys)
    return point, draws


def test_identical_methods_resample_identically():
    rng = np.random.default_rng(1)
    base = rng.random(30)
    point, draws = paired(long_frame({"a": base, "b": base.copy()}, tasks=3), ["a", "b"])
    assert point[1] - point[0] == 0 and np.array_equal(draws[0], draws[1])


def test_a_method_better_on_every_sample_is_better_in_every_resample():
    rng = np.random.default_rng(2)
    base = rng.random(20)
    _, draws = paired(long_frame({"base": base, "better": base + 0.05}, tasks=2), ["base", "better"])
    assert (draws[1] - draws[0] > 0).all() and stats.interval(draws[1] - draws[0])[0] > 0


def test_intervals_shrink_as_samples_grow():
    rng = np.random.default_rng(4)
    widths = []
    for n in (20, 80, 320):
        _, draws = paired(long_frame({"a": rng.random(n)}), ["a"])
        low, high = stats.interval(draws[0])
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2]
    assert widths[0] / widths[2] == pytest.approx(4, rel=0.35)  # ~ 1/sqrt(n)


def test_same_seed_same_result_other_seed_other_draws():
    rng = np.random.default_rng(5)
    frame = long_frame({"a": rng.random(40), "b": rng.random(40)}, tasks=2)
    first, second = paired(frame, ["a", "b"], seed=7)[1], paired(frame, ["a", "b"], seed=7)[1]
    assert np.array_equal(first, second)
    assert not np.array_equal(first, paired(frame, ["a", "b"], seed=8)[1])
    shuffled = frame.sample(frac=1, random_state=0)  # line order does not matter
    assert np.array_equal(first, paired(shuffled, ["a", "b"], seed=7)[1])


def test_statistic_is_mean_over_tasks_of_task_means():
    # task t0 has 1 sample, t1 has 3: the mean over tasks weighs each task equally.
    frame = pd.DataFrame({"task": ["t0", "t1", "t1", "t1"], "id": ["x", "a", "b", "c"],
                          "key": "m", "score": [1.0, 0.0, 0.0, 0.0]})
    point, draws = paired(frame, ["m"])
    assert point[0] == 0.5 and np.all(draws == 0.5)  # no within-task variance: every resample agrees


def test_rank_probabilities():
    draws = np.array([[3.0, 3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    first, expected = stats.rank_probabilities(draws)
    assert first.tolist() == [0.875, 0.125, 0.0]  # the tie for first in resample 3 is split
    assert expected.tolist() == [1.125, 1.875, 3.0]
    assert first.sum() == 1.0


