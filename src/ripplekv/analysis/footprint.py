"""The critical KV footprint: one number per method, the smallest budget at which it keeps at least 90% of the
full cache's fidelity (HELMET's follow-up work proposes such a summary in place of a curve).

Fidelity is measured by agreement with the full cache's answer (the teacher-forced share of its tokens the
compressed cache also ranks first): the full cache's own agreement is 1 by definition, so "90% of the full cache's
fidelity" is agreement >= 0.9, with no ratio of two noisy numbers. `measure="score"` uses the informative-task
score over the full cache's instead (the full cache's score is then taken as exact).

The interval comes from the per-budget intervals of the leaderboard: its low end is the smallest budget whose
interval's upper end reaches the threshold (the data cannot rule out that the method is good enough there), its
high end the smallest budget whose interval's lower end does (the data show it is). A method that reaches the
threshold at no budget of the run has no footprint (empty): it is above the run's largest budget.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.runs.files import REFERENCE

SHARE = 0.9  # the share of the full cache's fidelity a method must keep
# measure: (the leaderboard's point column, its interval's low and high columns)
MEASURES = {
    "agreement": ("agreement", "agreement_ci_low", "agreement_ci_high"),
    "score": ("avg_informative", "avg_informative_ci_low", "avg_informative_ci_high"),
}
COLUMNS = ["footprint", "footprint_low", "footprint_high", "footprint_measure"]


def footprint_label(measure: str = "agreement", share: float = SHARE) -> str:
    """How the footprint was measured, as the CSV and the page state it."""
    if measure == "agreement":
        return f"agreement >= {share:g}"
    return f"informative score >= {share:g} x the full cache's"


def _full_level(board: pd.DataFrame, column: str) -> float:
    """The full cache's value of `column` (1 for agreement when the board has no full-cache row)."""
    rows = board[board["method"] == REFERENCE]
    if column in rows and rows[column].notna().any():
        return float(rows[column].dropna().iloc[0])
    return 1.0 if column == MEASURES["agreement"][0] else float("nan")


def _smallest(budgets: np.ndarray, reached: np.ndarray) -> float:
    hits = budgets[reached]
    return float(hits.min()) if len(hits) else float("nan")


def critical_footprints(board: pd.DataFrame, measure: str = "agreement", share: float = SHARE) -> pd.DataFrame:
    """One row per compressed method of the leaderboard: `method`, `footprint` (a budget), `footprint_low`,
    `footprint_high` and `footprint_measure`. Empty numbers where the run cannot say (no budget reaches it, or the
    leaderboard lacks the measure's columns)."""
    point, low, high = MEASURES[measure]
    label = footprint_label(measure, share)
    rows = board[(board["method"] != REFERENCE) & board["budget"].notna()]
    methods = list(dict.fromkeys(rows["method"]))
    if point not in board or not methods:
        return pd.DataFrame({"method": methods, "footprint": np.nan, "footprint_low": np.nan,
                             "footprint_high": np.nan, "footprint_measure": label})
    threshold = share * _full_level(board, point)
    out = []
    for method in methods:
        own = rows[rows["method"] == method].sort_values("budget")
        budgets = own["budget"].astype(float).to_numpy()
        values = pd.to_numeric(own[point], errors="coerce").to_numpy(dtype=float)
        upper = pd.to_numeric(own[high], errors="coerce").to_numpy(dtype=float) if high in own else values
        lower = pd.to_numeric(own[low], errors="coerce").to_numpy(dtype=float) if low in own else values
        out.append({"method": method, "footprint": _smallest(budgets, values >= threshold),
                    "footprint_low": _smallest(budgets, upper >= threshold),
                    "footprint_high": _smallest(budgets, lower >= threshold), "footprint_measure": label})
    return pd.DataFrame(out, columns=["method", *COLUMNS])


def add_footprint(board: pd.DataFrame, measure: str = "agreement", share: float = SHARE) -> pd.DataFrame:
    """The leaderboard with the footprint columns on every row of each method (empty on the full cache's row);
    columns already there are replaced, so a re-rendered board never carries two."""
    found = critical_footprints(board, measure, share)
    plain = board.drop(columns=[c for c in COLUMNS if c in board.columns])
    merged = plain.merge(found, on="method", how="left")
    merged["footprint_measure"] = footprint_label(measure, share)
    merged.index = plain.index
    return merged
