"""How many samples a study needs: n per task from a pilot's spread, so its primary comparison can see the
effect the page calls meaningful.

The primary comparison is a paired difference of KL (the pair's second allocation minus its first, averaged
over the scorer x split cells), estimated as the mean over tasks of task means. With m samples in each of T
tasks its standard error is sqrt(mean_t var_t / (T m)) and its minimum detectable difference at 80% power
`inference.minimum_detectable(se, T (m - 1))`. The pilot (a few calibration prompts per task, never an
evaluation sample) gives var_t; n per task is the smallest m in [low, high] whose detectable difference is
at most `meaningful` at every budget, else `high`, and the record says so.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ripplekv.analysis import inference


def pair_differences(frame: pd.DataFrame, pairs: list[tuple[str, str]], budget: int,
                     measure: str = "kl") -> tuple[np.ndarray, np.ndarray]:
    """(per-sample difference: mean over `pairs` of second - first, task index) at one budget, complete samples."""
    lines = frame[frame["budget"] == budget]
    labels = list(dict.fromkeys(label for pair in pairs for label in pair))
    samples = inference.sample_matrix(lines.assign(key=lines["method"]), measure, labels)
    index = {label: i for i, label in enumerate(labels)}
    values = np.mean([samples.values[index[second]] - samples.values[index[first]] for first, second in pairs], axis=0)
    complete = np.isfinite(values)
    return values[complete], samples.tasks[complete]


def detectable_at(variances: np.ndarray, per_task: int) -> float:
    """The minimum detectable difference of a mean of task means, `per_task` samples in each task."""
    tasks = len(variances)
    se = math.sqrt(float(np.mean(variances)) / (tasks * per_task))
    return float(inference.minimum_detectable(se, tasks * (per_task - 1)))


def required_limit(frame: pd.DataFrame, pairs: list[tuple[str, str]], budgets, meaningful: float,
                   low: int, high: int) -> dict:
    """n per task (see the module docstring) and what it rests on, per budget."""
    per_budget, needed = {}, low
    for budget in budgets:
        values, tasks = pair_differences(frame, pairs, int(budget))
        variances = np.array([np.var(values[tasks == t], ddof=1) for t in np.unique(tasks) if (tasks == t).sum() > 1])
        if not len(variances):
            per_budget[int(budget)] = {"pilot_samples": int(len(values)), "sd": None, "n_per_task": high}
            needed = high
            continue
        m = next((m for m in range(max(low, 2), high + 1) if detectable_at(variances, m) <= meaningful), high)
        per_budget[int(budget)] = {"pilot_samples": int(len(values)), "sd": float(np.sqrt(np.mean(variances))),
                                   "n_per_task": m, "detectable_at_n": detectable_at(variances, m)}
        needed = max(needed, m)
    capped = any(entry.get("detectable_at_n") is None or entry["detectable_at_n"] > meaningful
                 for entry in per_budget.values())
    return {"limit": int(needed), "meaningful": meaningful, "low": low, "high": high, "capped": capped,
            "per_budget": per_budget,
            "rule": "the smallest n per task in [low, high] whose minimum detectable KL difference (80% power, "
                    "alpha 0.05) of the primary comparison is at most `meaningful` at every budget, from the "
                    "pilot's per-task variance; `capped`: high did not reach it"}
