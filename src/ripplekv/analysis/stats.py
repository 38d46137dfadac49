"""Paired, task-stratified bootstrap: for what has no closed form (rank probabilities, a rank's interval,
a rank correlation's interval).

A leaderboard number is a mean over tasks of per-task means over samples. The bootstrap redraws the
samples of each task (with replacement, within the task) and recomputes that same statistic. The
resample indices are drawn once per task and used for every method, so methods are always judged on the
same resampled questions (paired). Intervals of means and differences, and the tests, are not drawn
from it: with 5-10 samples per task its percentile intervals were too narrow (85-94% coverage where 95%
was asked), so those are `analysis.inference`'s t intervals and sign-flip tests.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import rankdata

RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95


@dataclass
class Bootstrap:
    """Resample indices per task, shared by every method. Build it with `Bootstrap.draw`."""

    tasks: list[str]
    ids: dict[str, list]  # task -> sample ids, sorted, so line order in the file does not matter
    indices: dict[str, np.ndarray]  # task -> [resamples, n] indices into ids[task]
    resamples: int

    @classmethod
    def draw(cls, frame: pd.DataFrame, resamples: int = RESAMPLES, seed: int = SEED) -> Bootstrap:
        """Indices for the samples (task, id) in `frame`; the same frame and seed give the same draws."""
        if resamples < 1:
            raise ValueError(f"resamples must be positive, got {resamples}")
        rng = np.random.default_rng(seed)
        tasks = sorted(frame["task"].unique())
        ids = {t: sorted(frame.loc[frame["task"] == t, "id"].unique()) for t in tasks}
        indices = {t: rng.integers(0, len(ids[t]), size=(resamples, len(ids[t]))) for t in tasks}
        return cls(tasks, ids, indices, resamples)

    def replicates(self, frame: pd.DataFrame, column: str, keys: list[str], key: str = "key") -> tuple[np.ndarray, np.ndarray]:
        """(point, draws): the mean over tasks of per-task means of `column` for each key, on the data
        ([k]) and on every resample ([k, resamples]). A key missing a sample has NaN there, which the
        means skip; a key missing a whole task is averaged over the tasks it has (as the leaderboard)."""
        point = np.full((len(self.tasks), len(keys)), np.nan)
        draws = np.full((len(self.tasks), len(keys), self.resamples), np.nan)
        with warnings.catch_warnings():  # all-NaN slices (a key without a task) are expected
            warnings.simplefilter("ignore", RuntimeWarning)
            for i, task in enumerate(self.tasks):
                rows = frame[frame["task"] == task]
                table = rows.pivot_table(index=key, columns="id", values=column, aggfunc="mean")
                values = table.reindex(index=keys, columns=self.ids[task]).to_numpy(dtype=float)  # [k, n]
                point[i] = np.nanmean(values, axis=1)
                draws[i] = np.nanmean(values[:, self.indices[task]], axis=2)  # [k, R, n] -> [k, R]
            return np.nanmean(point, axis=0), np.nanmean(draws, axis=0)


def interval(draws: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over the last axis (of a rank or a correlation's resampled values)."""
    tail = 100 * (1 - confidence) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanpercentile(draws, tail, axis=-1), np.nanpercentile(draws, 100 - tail, axis=-1)


def rank_probabilities(draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P(rank 1), expected rank) of each of k methods from their resampled scores [k, R], higher
    is better. Ties share: tied ranks are averaged, and a tie for first splits the win, so the
    probabilities sum to 1 over the methods."""
    ranks = rankdata(-draws, axis=0, method="average")
    top = draws == draws.max(axis=0, keepdims=True)
    wins = top / top.sum(axis=0, keepdims=True)
    return wins.mean(axis=1), ranks.mean(axis=1)
