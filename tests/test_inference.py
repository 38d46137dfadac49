"""Paired comparisons at small n: the interval's coverage, the sign-flip test, Holm, detectable differences.

The coverage check is the one the interval was chosen by (`scripts/interval_coverage.py` prints the full
comparison): synthetic paired differences with a known mean, at n = 10 (2 tasks of 5) and n = 50 (5 tasks
of 10), zero and nonzero, normal and score-like (mostly tied); the stratified t interval must cover about
95%, and the same check must fail an interval that covers 20 points less.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from scipy import stats as distributions

from ripplekv.analysis import inference

REPLICATIONS = 400
TOLERANCE = 0.035  # 3 standard errors of a coverage estimated from 400 replications at 95%


def synthetic(kind: str, n: int, tasks: int, delta: float, rng) -> tuple[np.ndarray, np.ndarray]:
    """[replications, n] paired differences with mean `delta` (each task its own offset, so stratifying matters)."""
    labels = np.repeat(np.arange(tasks), n // tasks)
    offset = rng.normal(0, 1, size=tasks)
    offset = (offset - offset.mean())[labels]  # task offsets that average to 0 over tasks
    if kind == "normal":
        noise = rng.normal(0, 1, size=(REPLICATIONS, n))
    else:  # score-like: most pairs tied, some one answer better, some worse
        noise = rng.choice([-1.0, 0.0, 1.0], p=[0.15, 0.7, 0.15], size=(REPLICATIONS, n))
    return delta + offset + noise, labels


def coverage(differences, labels, delta, confidence=inference.CONFIDENCE) -> float:
    estimate = inference.t_interval(differences, labels, confidence)
    return float(np.mean((estimate.low <= delta) & (delta <= estimate.high)))


def percentile_coverage(differences, labels, delta, resamples=400, seed=0) -> float:
    """The stratified percentile bootstrap's coverage on the same data: the interval the t interval replaced."""
    rng = np.random.default_rng(seed)
    draws = 0.0
    tasks = labels.max() + 1
    for k in range(tasks):
        columns = np.flatnonzero(labels == k)
        pick = columns[rng.integers(0, len(columns), size=(resamples, len(columns)))]
        draws = draws + differences[:, pick].mean(axis=-1) / tasks
    low, high = np.percentile(draws, [2.5, 97.5], axis=-1)
    return float(np.mean((low <= delta) & (delta <= high)))


@pytest.mark.parametrize("kind", ["normal", "score"])
@pytest.mark.parametrize("n, tasks", [(10, 2), (50, 5)])
@pytest.mark.parametrize("delta", [0.0, 0.4])
def test_the_t_interval_covers_95_percent_at_small_n(kind, n, tasks, delta):
    # A seed fixed by the case (hash() of a str is salted per process: with it every run drew new data, and the
    # score-like n=10 cases, whose coverage has SD 0.018 over seeds, failed about 1 run in 60)
    rng = np.random.default_rng(zlib.crc32(f"{kind}-{n}-{delta}".encode()))
    differences, labels = synthetic(kind, n, tasks, delta, rng)
    assert abs(coverage(differences, labels, delta) - 0.95) <= TOLERANCE
    # The check can fail: an interval covering 20 points less (a 75% interval read as 95%) does not pass.
    assert abs(coverage(differences, labels, delta, confidence=0.75) - 0.95) > TOLERANCE


def test_the_percentile_bootstrap_undercovers_at_n_10_which_is_why_t_was_chosen():
    rng = np.random.default_rng(7)
    differences, labels = synthetic("normal", 10, 2, 0.0, rng)
    t, percentile = coverage(differences, labels, 0.0), percentile_coverage(differences, labels, 0.0)
    assert percentile < 0.92 and abs(t - 0.95) < abs(percentile - 0.95)


def test_holm_matches_a_hand_computation():
    # m = 5 (the NaN is not a comparison). Sorted: 0.005, 0.01, 0.03, 0.04, 0.2 times 5, 4, 3, 2, 1:
    # 0.025, 0.04, 0.09, 0.08 -> 0.09 (monotone), 0.2; capped at 1.
    p = [0.01, 0.04, 0.03, 0.005, np.nan, 0.2]
    assert inference.holm(p)[[3, 0, 2, 1, 5]] == pytest.approx([0.025, 0.04, 0.09, 0.09, 0.2])
    assert np.isnan(inference.holm(p)[4])
    assert inference.holm([0.3, 0.6]).tolist() == [0.6, 0.6] and inference.holm([0.9, 0.8]).tolist() == [1.0, 1.0]
    assert inference.holm([]).size == 0


def test_the_sign_flip_p_is_exact_on_a_hand_example():
    # d = 1, 2, 3 in one task: of the 8 sign patterns only +-(1+2+3) reach |6|: p = 2/8.
    assert inference.sign_flip_p(np.array([[1.0, 2.0, 3.0]]), np.zeros(3, dtype=int))[0] == 0.25
    # d = 1, 1, 1, -1: patterns with |sum| >= 2 are those with 3 or 4 signs alike: (2 + 8) / 16.
    assert inference.sign_flip_p(np.array([[1.0, 1.0, 1.0, -1.0]]), np.zeros(4, dtype=int))[0] == 10 / 16


def test_the_sign_flip_statistic_weighs_each_task_equally():
    # d = +1 (task 0, alone) and -1, -1, -1 (task 1). Mean over tasks of task means: 1 - 1 = 0, so every pattern is
    # as extreme: p = 1. Pooled into one task the mean is -0.5, and only patterns with a 3-1 or 4-0 split of signs
    # reach |0.5|: 10 of 16.
    d = np.array([[1.0, -1.0, -1.0, -1.0]])
    assert inference.sign_flip_p(d, np.array([0, 1, 1, 1]))[0] == 1.0
    assert inference.sign_flip_p(d, np.zeros(4, dtype=int))[0] == 10 / 16


def test_identical_methods_give_p_1_and_missing_pairs_are_left_out():
    differences = np.array([[0.0] * 6, [0.5, np.nan, 0.5, 0.5, 0.5, 0.5]])
    p = inference.sign_flip_p(differences, np.zeros(6, dtype=int))
    assert p[0] == 1.0 and p[1] == 2 / 32  # 5 nonzero differences, all one sign
    assert np.isnan(inference.sign_flip_p(np.full((1, 3), np.nan), np.zeros(3, dtype=int))[0])


def test_monte_carlo_p_has_the_plus_one_correction_and_holds_its_level():
    labels = np.repeat(np.arange(4), 10)  # 40 nonzero differences: past EXACT_LIMIT, sampled
    p = inference.sign_flip_p(np.ones((1, 40)), labels, permutations=999)
    assert p[0] == 1 / 1000  # no random pattern reaches the all-positive sum: (1 + 0) / (1 + 999)
    rng = np.random.default_rng(3)
    null = rng.normal(0, 1, size=(300, 12))  # exact enumeration, 12 nonzero differences per row
    assert np.mean(inference.sign_flip_p(null, np.repeat(np.arange(2), 6)) < 0.05) <= 0.05 + 0.035


def test_detectable_difference_and_interval_pieces():
    assert inference.minimum_detectable(1.0, np.inf) == pytest.approx(1.959964 + 0.841621, rel=1e-5)
    assert inference.minimum_detectable(2.0, 9) == pytest.approx(2 * (distributions.t.ppf(0.975, 9) + distributions.t.ppf(0.8, 9)))
    # One task of 10: the ordinary one-sample t interval.
    x = np.arange(10.0)
    estimate = inference.t_interval(x, np.zeros(10, dtype=int))
    half = distributions.t.ppf(0.975, 9) * x.std(ddof=1) / np.sqrt(10)
    assert estimate.point[0] == 4.5 and estimate.low[0] == pytest.approx(4.5 - half) and estimate.df[0] == pytest.approx(9)
    # A task with a single sample borrows the other tasks' pooled variance instead of giving no interval.
    lone = inference.t_interval(np.array([1.0, 0.0, 1.0, 2.0]), np.array([0, 1, 1, 1]))
    assert np.isfinite(lone.low[0]) and lone.point[0] == pytest.approx((1.0 + 1.0) / 2)
    # No spread: the interval is the point.
    flat = inference.t_interval(np.full(6, 0.2), np.repeat(np.arange(2), 3))
    assert flat.low[0] == pytest.approx(0.2) and flat.high[0] == pytest.approx(0.2)


def test_the_kl_ratio_interval_stays_positive_and_holds_the_ratio():
    rng = np.random.default_rng(4)
    base = rng.uniform(0.2, 1.0, size=(1, 20))
    other = base * rng.uniform(0.1, 0.6, size=(1, 20))  # far closer on every sample, with spread
    labels = np.repeat(np.arange(2), 10)
    ratio, low, high = inference.ratio_interval(other, base, labels)
    assert 0 < low[0] < ratio[0] < high[0] < 1
    same, low, high = inference.ratio_interval(base, base, labels)
    assert same[0] == low[0] == high[0] == 1.0


def test_verdicts_need_the_adjusted_p_and_the_interval():
    assert inference.verdict(0.1, 0.5, 0.01) == "better" and inference.verdict(-0.5, -0.1, 0.01) == "worse"
    assert inference.verdict(-0.5, -0.1, 0.01, lower_is_better=True) == "closer"
    assert inference.verdict(0.1, 0.5, 0.06) == "tied" and inference.verdict(-0.1, 0.5, 0.001) == "tied"
    assert inference.verdict(np.nan, np.nan, np.nan) == ""


def test_exact_p_by_halves_matches_every_pattern_summed_directly():
    rng = np.random.default_rng(5)
    differences = rng.normal(0.2, 1.0, size=(3, 18))
    differences[2, :4] = 0.0  # zeros pad every pattern equally
    tasks = np.repeat(np.arange(3), 6)
    weights = 1.0 / (3 * 6)
    bits = (np.arange(2**18)[:, None] >> np.arange(18)) & 1
    sums = np.abs((1.0 - 2.0 * bits) @ (weights * differences).T)  # [2^18, rows], every pattern written out
    observed = np.abs((weights * differences).sum(axis=1))
    direct = (sums >= observed - 1e-12).mean(axis=0)
    assert inference.sign_flip_p(differences, tasks) == pytest.approx(direct, abs=1e-15)


def test_a_monte_carlo_p_near_a_threshold_is_refined_and_one_far_from_it_is_not():
    rng = np.random.default_rng(6)
    tasks = np.repeat(np.arange(4), 10)  # 40 nonzero differences: sampled
    noise = rng.normal(0, 1, size=(2, 40))
    near = noise[0] - noise[0].mean() + 0.33 * noise[0].std()  # p around 0.05
    far = noise[1] - noise[1].mean()  # p near 1
    p = inference.sign_flip_p(np.vstack([near, far]), tasks, permutations=1000, refined=50_000)
    assert 0.0125 < p[0] < 0.1  # within a factor 2 of alpha (a family of 2: alpha/4 .. 2 alpha)
    assert (p[0] * 50_001) == pytest.approx(round(p[0] * 50_001))  # a count out of 50 000 resamples
    assert (p[1] * 1001) == pytest.approx(round(p[1] * 1001)) and p[1] > 0.5  # out of the first 1 000


def test_a_comparison_that_could_not_see_the_meaningful_effect_is_underpowered_not_tied():
    assert inference.verdict(-0.1, 0.5, 0.2, detectable=0.4, meaningful=0.05) == "underpowered"
    assert inference.verdict(-0.1, 0.5, 0.2, detectable=0.01, meaningful=0.05) == "tied"
    assert inference.verdict(0.1, 0.5, 0.01, detectable=0.4, meaningful=0.05) == "better"  # significant stays so
    assert inference.verdict(-0.1, 0.5, 0.2) == "tied"  # no meaningful effect stated
    assert inference.verdict(-0.1, 0.5, 1.0, detectable=np.nan, meaningful=0.05) == "underpowered"  # one sample


def test_a_single_sample_has_no_interval_rather_than_a_zero_width_one():
    estimate = inference.t_interval(np.array([[0.7, np.nan, np.nan]]), np.zeros(3, dtype=int))
    assert estimate.point[0] == 0.7 and np.isnan(estimate.low[0]) and np.isnan(estimate.high[0])
