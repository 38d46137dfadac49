"""Which interval covers 95% at this suite's n? The check `analysis.inference` chose its interval by.

Synthetic paired differences with a known mean (0 and 0.5), stratified over tasks as a run is (n = 10 as 2
tasks of 5 and as 1 task of 10, n = 50 as 5 tasks of 10), from four shapes: normal, lognormal (skewed like KL
differences), score-like (mostly ties, some +-1) and Student t with 3 degrees of freedom (heavy tails). For
each, the share of replications whose 95% interval holds the true mean, for the stratified t interval
(Welch-Satterthwaite df), the stratified percentile bootstrap and BCa (jackknife acceleration).

    .venv/bin/python scripts/interval_coverage.py [--replications 1000] [--resamples 1000]
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from scipy import stats as distributions

from ripplekv.analysis import inference


def draw(kind: str, shape: tuple[int, int], delta: float, rng) -> np.ndarray:
    if kind == "normal":
        noise = rng.normal(0, 1, shape)
    elif kind == "lognormal":
        noise = rng.lognormal(0, 1, shape) - np.exp(0.5)
    elif kind == "score":
        noise = rng.choice([-1.0, 0.0, 1.0], p=[0.15, 0.7, 0.15], size=shape)
    else:
        noise = rng.standard_t(3, shape)
    return delta + noise


def bootstrap(values: np.ndarray, tasks: np.ndarray, resamples: int, rng) -> np.ndarray:
    """[replications, resamples] stratified bootstrap means over tasks of task means."""
    count = tasks.max() + 1
    total = 0.0
    for k in range(count):
        columns = np.flatnonzero(tasks == k)
        pick = columns[rng.integers(0, len(columns), size=(resamples, len(columns)))]
        total = total + values[:, pick].mean(axis=-1) / count
    return total


def bca(values: np.ndarray, tasks: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    theta = inference.stratified_mean(values, tasks)
    share = ((draws < theta[:, None]).sum(-1) + 0.5 * (draws == theta[:, None]).sum(-1)) / draws.shape[1]
    z0 = distributions.norm.ppf(np.clip(share, 1 / draws.shape[1], 1 - 1 / draws.shape[1]))
    jack = np.stack([inference.stratified_mean(np.delete(values, i, axis=1), np.delete(tasks, i))
                     for i in range(values.shape[1])], axis=1)
    u = jack.mean(axis=1, keepdims=True) - jack
    a = (u**3).sum(1) / (6 * ((u**2).sum(1)) ** 1.5 + 1e-300)
    ends = []
    for z in distributions.norm.ppf([0.025, 0.975]):
        level = distributions.norm.cdf(z0 + (z0 + z) / (1 - a * (z0 + z)))
        ends.append(np.array([np.quantile(row, q) for row, q in zip(draws, level)]))
    return ends[0], ends[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=1000)
    parser.add_argument("--resamples", type=int, default=1000)
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n, count in ((10, 2), (10, 1), (50, 5)):
        tasks = np.repeat(np.arange(count), n // count)
        for kind in ("normal", "lognormal", "score", "t3"):
            for delta in (0.0, 0.5):
                values = draw(kind, (options.replications, n), delta, rng)
                t = inference.t_interval(values, tasks)
                draws = bootstrap(values, tasks, options.resamples, rng)
                low, high = np.percentile(draws, [2.5, 97.5], axis=1)
                b_low, b_high = bca(values, tasks, draws)
                rows.append({"n": n, "tasks": count, "differences": kind, "true mean": delta,
                             "t": np.mean((t.low <= delta) & (delta <= t.high)),
                             "percentile": np.mean((low <= delta) & (delta <= high)),
                             "BCa": np.mean((b_low <= delta) & (delta <= b_high))})
    print(pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3f"))


if __name__ == "__main__":
    main()
