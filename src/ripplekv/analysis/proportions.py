"""Intervals for accuracies (0/1 outcomes per sample) that stay on their scale: [0, 100] for a mean, [-100, 100]
for a paired difference.

A t interval on 0/100 outcomes leaves the scale at the few samples a task has here (the full cache's 10/12 on
niah read 83.33 [58.60, 108.07]), so an accuracy gets score intervals instead:

- **One task, one method**: Wilson's score interval for k successes of n.
- **One task, two methods on the same samples**: Tango's score interval for paired proportions (Tango 1998):
  the differences a score test of the discordant pairs would not reject, the discordant share re-estimated under
  each. Chosen by its coverage, computed exactly (every outcome enumerated, tests/test_proportions.py) at n = 12
  over 200 random 2x2 truths: mean 96.8%, lowest 94.3%. Newcombe's hybrid method 10 reached 93.5% and 85.5%
  there, and collapses to +-4 points when no pair is discordant (it trusts the observed perfect correlation);
  the exact interval conditional on the discordant pairs has zero width then, and its bound sits on the
  observed value when every discordant pair goes one way (the Gemma row, 10 of 12 against 0 of 12). Tango's
  never leaves [-1, 1] and at no discordant pair gives about the rule of three (+-0.24 at n = 12).
- **Several tasks** (a mean over tasks of per-task accuracies, each task weighing the same): the per-task
  intervals combined by MOVER (Zou & Donner 2008; independent tasks): `point - sqrt(sum w_k^2 (point_k - low_k)^2)`
  and likewise above. It reduces to the per-task interval for one task and stays inside the hull of the
  per-task bounds, hence on the scale.

A task is an accuracy when every one of its scores in the run is 0 or 1 (`accuracy_tasks`): niah, passkey,
RULER's single-needle tasks; F1, ROUGE and multi-needle tasks (fractions) keep their t intervals.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as distributions

CONFIDENCE = 0.95


def accuracy_tasks(frame: pd.DataFrame, column: str = "score") -> set[str]:
    """The tasks whose every `column` value in `frame` is 0 or 1: per-sample outcomes that are right or wrong."""
    values = frame[["task", column]].dropna()
    binary = values[column].isin((0, 1)).groupby(values["task"]).all()
    return set(binary[binary].index)


def _z(confidence: float) -> float:
    return float(distributions.norm.ppf(0.5 + confidence / 2))


def wilson(successes, n, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Wilson's score interval (low, high) of a proportion, elementwise; NaN where n is 0."""
    k, n = np.asarray(successes, dtype=float), np.asarray(n, dtype=float)
    z = _z(confidence)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        low = np.where(k <= 0, 0.0, np.clip(centre - half, 0.0, 1.0))  # exact ends, not 1e-17 from rounding
        return low, np.where(k >= n, 1.0, np.clip(centre + half, 0.0, 1.0))


def tango_paired(both, first_only, second_only, neither, confidence: float = CONFIDENCE):
    """(difference, low, high) of p_first - p_second from the paired 2x2 counts: Tango's score interval, the
    differences whose score statistic (the discordant counts' difference over its standard error with the
    discordant share re-estimated under that difference) stays within z, found by bisection on each side."""
    b, c = np.asarray(first_only, dtype=float), np.asarray(second_only, dtype=float)
    n = np.asarray(both, dtype=float) + b + c + np.asarray(neither, dtype=float)
    z = _z(confidence)
    with np.errstate(divide="ignore", invalid="ignore"):
        point = (b - c) / n

        def score(delta):
            w = -b - c + (2 * n - b + c) * delta
            second_share = (np.sqrt(np.maximum(w * w + 8 * n * c * delta * (1 - delta), 0.0)) - w) / (4 * n)
            variance = n * (2 * second_share + delta * (1 - delta))
            gap = b - c - n * delta
            return np.where(variance > 0, gap / np.sqrt(np.where(variance > 0, variance, 1.0)), np.sign(gap) * np.inf)

        low = _bisect(score, np.full_like(point, -1.0), point, lambda s: s <= z)
        high = _bisect(score, point, np.full_like(point, 1.0), lambda s: s < -z)
        return point, low, high


def _bisect(score, left, right, right_side, steps: int = 60) -> np.ndarray:
    """The boundary in [left, right] where `right_side(score(x))` turns true (it holds at `right`, not at `left`,
    the score decreasing in x), elementwise; 60 halvings leave it to within 1e-18."""
    for _ in range(steps):
        middle = (left + right) / 2
        turned = right_side(score(middle))
        left, right = np.where(turned, left, middle), np.where(turned, middle, right)
    return right


def _mover(points: np.ndarray, lows: np.ndarray, highs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the equal-weight mean over tasks (columns; NaN: the row lacks the task) and its MOVER interval."""
    present = np.isfinite(points)
    weight = np.where(present, 1.0, 0.0) / np.maximum(present.sum(axis=1, keepdims=True), 1)
    with np.errstate(invalid="ignore"):
        point = np.where(present, weight * points, 0.0).sum(axis=1)
        below = np.sqrt(np.where(present, (weight * (points - lows)) ** 2, 0.0).sum(axis=1))
        above = np.sqrt(np.where(present, (weight * (highs - points)) ** 2, 0.0).sum(axis=1))
    none = ~present.any(axis=1)
    return (np.where(none, np.nan, point), np.where(none, np.nan, point - below),
            np.where(none, np.nan, point + above))


def accuracy_interval(values: np.ndarray, tasks: np.ndarray, top: float = 100.0,
                      confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean over tasks of per-task accuracy, low, high) per row of outcomes [rows, samples] that are 0 or `top`
    (NaN: missing), on the scale of `top`: Wilson per task, MOVER over tasks."""
    values = np.atleast_2d(np.asarray(values, dtype=float)) / top
    count = max(int(tasks.max()) + 1, 1) if tasks.size else 1
    shape = (values.shape[0], count)
    points, lows, highs = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    for k in range(count):
        block = values[:, tasks == k]
        n = np.isfinite(block).sum(axis=1)
        wins = np.nansum(block, axis=1)
        low, high = wilson(wins, n, confidence)
        has = n > 0
        points[has, k], lows[has, k], highs[has, k] = wins[has] / n[has], low[has], high[has]
    point, low, high = _mover(points, lows, highs)
    return top * point, top * low, top * high


def paired_accuracy_interval(first: np.ndarray, second: np.ndarray, tasks: np.ndarray, top: float = 100.0,
                             confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(difference first - second, low, high) per row, over the samples both have, on the scale of `top`:
    Tango's paired interval per task, MOVER over tasks."""
    first = np.atleast_2d(np.asarray(first, dtype=float)) / top
    second = np.atleast_2d(np.asarray(second, dtype=float)) / top
    both = np.isfinite(first) & np.isfinite(second)
    count = max(int(tasks.max()) + 1, 1) if tasks.size else 1
    shape = (first.shape[0], count)
    points, lows, highs = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    for k in range(count):
        mask = both[:, tasks == k]
        one, two = first[:, tasks == k] > 0.5, second[:, tasks == k] > 0.5
        cells = [(mask & x & y).sum(axis=1) for x, y in ((one, two), (one, ~two), (~one, two), (~one, ~two))]
        has = mask.sum(axis=1) > 0
        delta, low, high = tango_paired(*cells, confidence=confidence)
        points[has, k], lows[has, k], highs[has, k] = delta[has], low[has], high[has]
    point, low, high = _mover(points, lows, highs)
    return top * point, top * low, top * high
