"""Paired comparisons that hold at a few dozen samples: intervals, a sign-flip test, Holm, detectable sizes.

Every number a table compares is the same statistic: the mean over tasks of per-task means over samples,
so each task weighs the same however many samples it has. A comparison of two methods is that statistic
of their per-sample differences (the same questions on both sides: paired).

- **Interval**: a stratified t interval. Its standard error is `sqrt(sum_k s_k^2 / (K^2 n_k))` (s_k the SD
  of task k's values, n_k its samples, K tasks) and its degrees of freedom Welch-Satterthwaite's,
  `se^4 / sum_k (s_k^2 / (K^2 n_k))^2 / (n_k - 1)`. Chosen by a coverage check (`scripts/interval_coverage.py`;
  tests/test_inference.py keeps it) on synthetic paired data at n = 10 and 50, known zero and nonzero
  differences, 1000 replications: on normal, heavy-tailed (t3) and score-like (mostly tied) differences
  this interval covered 94-97%, the stratified percentile bootstrap 86-95% and BCa 84-95% (both too
  narrow with 5-10 samples per task). On strongly skewed (lognormal) differences all three undercover,
  t least: 84-86% at n = 10 (bootstrap 78-83%), 90-91% at n = 50 (88-91%). A task with one sample
  borrows the pooled within-task variance.
  Accuracies (0/1 outcomes) get score intervals instead (`analysis.proportions`: Wilson, Tango's paired
  interval), and every interval is cut to what the measure can be (`Samples.bounds`: a score in [0, 100], a
  KL at least 0): the true value lies there, so the cut never lowers coverage.
- **Test**: a paired sign-flip permutation test of "the two methods are exchangeable on every sample":
  each sample's difference keeps or flips its sign, the statistic is recomputed with the task weights
  (flips never move a sample across tasks: stratified by construction), and p is the share of flips at
  least as extreme as observed, two-sided. Every pattern is counted when at most `EXACT_LIMIT` differences
  are nonzero (exact p; the 2^w sums are two halves' sums added, counted by sorting one half). Otherwise
  `PERMUTATIONS` random patterns, `p = (1 + hits) / (1 + R)`, and again with `REFINED_PERMUTATIONS` for every
  p within a factor 2 of a threshold Holm can apply to it (alpha/m .. alpha, m the family's size), so a
  verdict never turns on Monte Carlo noise.
- **Holm**: a table making m comparisons adjusts its p-values by Holm's step-down rule (family-wise
  error at alpha, no independence assumed); a difference is "better" / "worse" only when its adjusted p
  is below 0.05, "tied" otherwise.
- **Minimum detectable difference**: `(t_{1-alpha/2, df} + t_{power, df}) x se`, alpha 0.05 and 80% power:
  the true difference a comparison of this spread at this n would call significant 80% of the time (for an
  accuracy difference, se is the one its score interval implies, `width / (2 z_0.975)`: the per-sample SD is 0
  when no pair is discordant, which would make any n look powerful). A
  difference that is not significant reads "underpowered" instead of "tied" when its detectable difference
  exceeds the effect the page calls meaningful (`MEANINGFUL`): such a comparison could not have seen it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
from scipy import stats as distributions

from ripplekv.analysis import proportions

CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8
PERMUTATIONS = 10_000
REFINED_PERMUTATIONS = 200_000  # for a p within a factor 2 of a threshold (module docstring)
EXACT_LIMIT = 32  # nonzero differences up to which every sign pattern is counted (2^32 patterns, 2 x 2^16 sums)
SEED = 0
# The smallest difference the page calls meaningful, per measure: KL per answer token (nats) and score points
# (0-100). A comparison whose detectable difference exceeds it is "underpowered", not "tied".
MEANINGFUL = {"kl": 0.05, "score": 5.0}
Z95 = float(distributions.norm.ppf(0.5 + CONFIDENCE / 2))


@dataclass
class Samples:
    """Per-sample values of several keys (methods, or method x budget rows) on one set of samples."""

    values: np.ndarray  # [keys, samples], NaN where a key lacks the sample
    tasks: np.ndarray  # [samples], the task index of each sample
    ids: list  # [(task, id)] of each sample, sorted, so line order in a file does not matter
    accuracy: np.ndarray | None = None  # [task index]: the task's values are outcomes, 0 or `bounds[1]`
    bounds: tuple[float, float] = (-np.inf, np.inf)  # what a value can be (a score 0-100, a KL >= 0)

    def rows(self, index) -> Samples:
        return Samples(self.values[index], self.tasks, self.ids, self.accuracy, self.bounds)

    def all_accuracy(self, values: np.ndarray) -> np.ndarray:
        """Per row of `values` [rows, samples]: whether every task the row has values on is an accuracy."""
        if self.accuracy is None or not self.tasks.size:
            return np.zeros(len(values), dtype=bool)
        counted = np.isfinite(values)
        return ~(counted & ~self.accuracy[self.tasks]).any(axis=1) & counted.any(axis=1)


def sample_matrix(frame: pd.DataFrame, column: str, keys: list, key: str = "key", accuracy=(),
                  bounds: tuple[float, float] = (-np.inf, np.inf)) -> Samples:
    """`column` per key and sample, from lines (task, id, key, column); a line repeated averages. `accuracy`:
    the tasks whose values are 0/`bounds[1]` outcomes (`proportions.accuracy_tasks`)."""
    table = frame.pivot_table(index=key, columns=["task", "id"], values=column, aggfunc="mean")
    table = table.reindex(index=keys).sort_index(axis=1)
    ids = list(table.columns)
    codes, names = pd.factorize(pd.Index([task for task, _ in ids]), sort=True)
    flags = np.array([name in set(accuracy) for name in names], dtype=bool)
    return Samples(table.to_numpy(dtype=float, copy=True), np.asarray(codes, dtype=int), ids, flags, bounds)


def mean_interval(values: Samples, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of each row's mean over tasks of task means: Wilson/MOVER where every task the row has is an
    accuracy (`analysis.proportions`), the stratified t interval otherwise, cut to `values.bounds`."""
    estimate = t_interval(values.values, values.tasks, confidence)
    low, high = estimate.low, estimate.high
    binary = values.all_accuracy(values.values)
    if binary.any():
        _, low[binary], high[binary] = proportions.accuracy_interval(values.values[binary], values.tasks,
                                                                     values.bounds[1], confidence)
    return np.clip(low, *values.bounds), np.clip(high, *values.bounds)


def _task_moments(values: np.ndarray, tasks: np.ndarray):
    """Per row and task: count, mean and unbiased variance of the non-missing values ([rows, tasks] each)."""
    count_of = np.zeros((values.shape[0], tasks.max() + 1 if tasks.size else 0))
    mean_of, var_of = np.full_like(count_of, np.nan), np.full_like(count_of, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for k in range(count_of.shape[1]):
            block = values[:, tasks == k]
            count_of[:, k] = np.isfinite(block).sum(axis=1)
            mean_of[:, k] = np.nanmean(block, axis=1)
            var_of[:, k] = np.nanvar(block, axis=1, ddof=1)
    return count_of, mean_of, var_of


def stratified_mean(values: np.ndarray, tasks: np.ndarray) -> np.ndarray:
    """Mean over tasks (those a row has) of per-task means, per row."""
    _, mean_of, _ = _task_moments(np.atleast_2d(values), tasks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(mean_of, axis=1)


@dataclass
class Estimate:
    """Per row: the statistic, its t interval, standard error and degrees of freedom."""

    point: np.ndarray
    low: np.ndarray
    high: np.ndarray
    se: np.ndarray
    df: np.ndarray

    def detectable(self, alpha: float = ALPHA, power: float = POWER) -> np.ndarray:
        """The minimum detectable difference at this spread and n (module docstring)."""
        return minimum_detectable(self.se, self.df, alpha, power)


def t_interval(values: np.ndarray, tasks: np.ndarray, confidence: float = CONFIDENCE) -> Estimate:
    """The stratified t interval of each row's mean over tasks of task means (module docstring)."""
    values = np.atleast_2d(np.asarray(values, dtype=float))
    count, mean, var = _task_moments(values, tasks)
    present = count > 0
    tasks_per_row = present.sum(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        point = np.nanmean(mean, axis=1)
        spread = count >= 2
        pooled_df = np.where(spread, count - 1, 0).sum(axis=1)
        pooled = np.where(spread, (count - 1) * var, 0).sum(axis=1) / pooled_df
        var = np.where(present & ~spread, pooled[:, None], var)  # one-sample tasks borrow the pooled variance
        dof = np.where(spread, count - 1, pooled_df[:, None])
        part = np.where(present, var / (np.maximum(count, 1) * tasks_per_row[:, None] ** 2), 0.0)
        se = np.sqrt(part.sum(axis=1))
        denominator = np.where(present & (part > 0), part**2 / np.maximum(dof, 1), 0.0).sum(axis=1)
        df = np.where(denominator > 0, se**4 / np.where(denominator > 0, denominator, 1.0), np.inf)
        quantile = distributions.t.ppf(0.5 + confidence / 2, df)
        half = np.where(se > 0, quantile * se, np.where(np.isnan(se), np.nan, 0.0))  # no spread to estimate: none
    return Estimate(point, point - half, point + half, se, df)


def ratio_interval(first: np.ndarray, second: np.ndarray, tasks: np.ndarray,
                   confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ratio, low, high) of the stratified means of `first` over `second`, row by row, over the samples both have:
    a t interval for the log ratio from the paired delta method (per sample `a/mean_a - b/mean_b`, whose stratified
    mean's standard error is the log ratio's), so both ends stay positive. NaN where a mean is not positive."""
    first, second = np.atleast_2d(first).astype(float), np.atleast_2d(second).astype(float)
    both = np.isfinite(first) & np.isfinite(second)
    first, second = np.where(both, first, np.nan), np.where(both, second, np.nan)
    mean_a, mean_b = stratified_mean(first, tasks), stratified_mean(second, tasks)
    with np.errstate(all="ignore"):
        ratio = np.where((mean_a > 0) & (mean_b > 0), mean_a / mean_b, np.nan)
        spread = t_interval(first / mean_a[:, None] - second / mean_b[:, None], tasks, confidence)
        half = (spread.high - spread.low) / 2
        return ratio, ratio * np.exp(-half), ratio * np.exp(half)


def minimum_detectable(se, df, alpha: float = ALPHA, power: float = POWER) -> np.ndarray:
    """`(t_{1-alpha/2, df} + t_{power, df}) x se`: the smallest true difference found with this power."""
    se, df = np.asarray(se, dtype=float), np.asarray(df, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return (distributions.t.ppf(1 - alpha / 2, df) + distributions.t.ppf(power, df)) * se


def sign_flip_p(differences: np.ndarray, tasks: np.ndarray, permutations: int = PERMUTATIONS,
                seed: int = SEED, refined: int = REFINED_PERMUTATIONS, alpha: float = ALPHA) -> np.ndarray:
    """Two-sided sign-flip p-value per row of paired differences [rows, samples] (NaN: a sample the pair
    lacks, left out); the rows are one Holm family. Exact when at most EXACT_LIMIT differences are nonzero,
    Monte Carlo otherwise, refined near a threshold (module docstring)."""
    differences = np.atleast_2d(np.asarray(differences, dtype=float))
    count, _, _ = _task_moments(differences, tasks)
    present = count > 0
    with np.errstate(divide="ignore", invalid="ignore"):  # each task weighs 1/K, each of its samples 1/(K n_k)
        weight = 1.0 / (present.sum(axis=1, keepdims=True) * count[:, tasks])
    contribution = np.where(np.isfinite(differences), weight * differences, 0.0)  # [rows, samples]
    nonzero = (contribution != 0).sum(axis=1)
    observed = np.abs(contribution.sum(axis=1))
    threshold = observed - 1e-9 * np.abs(contribution).sum(axis=1)  # a pattern counts when |sum| >= this
    p = np.where(present.any(axis=1), 1.0, np.nan)  # no nonzero difference: nothing to flip, p = 1
    for row in np.flatnonzero((nonzero > 0) & (nonzero <= EXACT_LIMIT)):
        p[row] = _exact_share(contribution[row][contribution[row] != 0], threshold[row])
    sampled = np.flatnonzero(nonzero > EXACT_LIMIT)
    if sampled.size:
        rng = np.random.default_rng(seed)
        p[sampled] = _sampled_share(contribution[sampled], threshold[sampled], permutations, rng)
        family = max(int(np.isfinite(p).sum()), 1)
        near = sampled[(p[sampled] >= alpha / (2 * family)) & (p[sampled] <= 2 * alpha)]
        if near.size and refined > permutations:
            p[near] = _sampled_share(contribution[near], threshold[near], refined, rng)
    return p


def _exact_share(terms: np.ndarray, threshold: float) -> float:
    """The share of the 2^w sign patterns of `terms` whose |signed sum| reaches `threshold`: every pattern is a
    pattern of the first half plus one of the second, so the sums of one half, sorted, are counted against each
    sum of the other (2 x 2^(w/2) sums instead of 2^w)."""
    if threshold <= 0:
        return 1.0
    half = terms.size // 2
    left = _all_signs(half) @ terms[:half]
    right = np.sort(_all_signs(terms.size - half) @ terms[half:])
    above = right.size - np.searchsorted(right, threshold - left, side="left")  # left + right >= threshold
    below = np.searchsorted(right, -threshold - left, side="right")  # left + right <= -threshold
    return float((above.sum() + below.sum()) / (left.size * right.size))


def _sampled_share(contribution: np.ndarray, threshold: np.ndarray, permutations: int, rng,
                   chunk: int = 20_000) -> np.ndarray:
    """`(1 + hits) / (1 + R)` per row over R random sign patterns shared by the rows, drawn `chunk` at a time."""
    hits = np.zeros(len(contribution))
    for start in range(0, permutations, chunk):
        flips = rng.choice((-1.0, 1.0), size=(min(chunk, permutations - start), contribution.shape[1]))
        hits += (np.abs(flips @ contribution.T) >= threshold).sum(axis=0)
    return (1 + hits) / (1 + permutations)


@lru_cache(maxsize=EXACT_LIMIT // 2 + 2)
def _all_signs(size: int) -> np.ndarray:
    """Every sign pattern of `size` differences, [2^size, size]."""
    bits = (np.arange(2**size)[:, None] >> np.arange(size)) & 1
    return 1.0 - 2.0 * bits


def holm(p) -> np.ndarray:
    """Holm's step-down adjustment of the p-values of one family (NaN entries are not comparisons):
    the i-th smallest of m becomes `max over j <= i of min(1, (m - j + 1) p_(j))`."""
    p = np.asarray(p, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    tested = np.flatnonzero(np.isfinite(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    m = len(order)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def verdict(low, high, p_adjusted, lower_is_better: bool = False, detectable=None, meaningful=None) -> str:
    """`better` / `worse` (for KL: `closer` / `further`) only when the adjusted p is below ALPHA and the
    interval excludes 0; otherwise `underpowered` when the comparison's minimum detectable difference
    (`detectable`) exceeds the `meaningful` effect, else `tied`; empty without a comparison."""
    if p_adjusted is None or pd.isna(p_adjusted) or pd.isna(low):
        return ""
    if p_adjusted >= ALPHA or low <= 0 <= high:
        # NaN: no spread to estimate (a single sample), so nothing could have been detected
        weak = meaningful is not None and detectable is not None and not detectable <= meaningful
        return "underpowered" if weak else "tied"
    above = low > 0
    if lower_is_better:
        return "further" if above else "closer"
    return "better" if above else "worse"
