"""Variants that keep more than their budget: a method that spends more than the memory B stands for
(`L x H_kv x B` full-precision entries on the prompt) by design, such as kvpress's rounding of LU-KV
(`lukv:rounding=kvpress`) or GraceKV's `ends=free`, is not at the budget it is filed under. Ranking it beside
the exact methods would reward the extra memory, so reports flag it (`over_budget`) and leave it out of ranks,
verdicts and the headline, as they do the answer-aware ceilings; its numbers stay in the tables, shown apart."""

from __future__ import annotations

import pandas as pd

COLUMN = "over_budget"


def over_budget(frame: pd.DataFrame) -> frozenset[str]:
    """Labels of the methods that kept more bytes than the budget stands for on some sample (`kv_bytes` over
    `kv_budget_bytes`, which every eval line has; older lines without them never count)."""
    if not {"kv_bytes", "kv_budget_bytes"} <= set(frame.columns):
        return frozenset()
    kept = pd.to_numeric(frame["kv_bytes"], errors="coerce")
    allowed = pd.to_numeric(frame["kv_budget_bytes"], errors="coerce")
    return frozenset(str(method) for method in frame.loc[kept > allowed, "method"].unique())


def flag(board: pd.DataFrame, labels) -> pd.DataFrame:
    """`board` with the `over_budget` column last (True on every row of a flagged method), and its
    verdicts saying so (the tables leave unranked rows unjudged under the ceilings' word)."""
    flagged = board["method"].astype(str).isin(set(labels))
    board = board.drop(columns=[COLUMN], errors="ignore")
    for verdict in ("kl_verdict", "verdict"):
        if verdict in board:
            board.loc[flagged & board[verdict].eq("answer-aware"), verdict] = "over budget"
    board[COLUMN] = flagged
    return board


def shown(view: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard for reading: the flag right after `rank` when some row is over budget, else not shown."""
    if COLUMN not in view:
        return view
    flagged = view.pop(COLUMN).astype(bool)
    if flagged.any():
        view.insert(view.columns.get_loc("rank") + 1 if "rank" in view else 0, "over budget",
                    flagged.map({True: "yes", False: ""}))
    return view


def note(labels, present) -> list[str]:
    """summary.md's lines naming the flagged methods present in a table (none: no lines)."""
    marked = [m for m in dict.fromkeys(map(str, present)) if m in set(labels)]
    if not marked:
        return []
    names = ", ".join(f"`{m}`" for m in marked)
    return [f"Over budget: {names} kept more than the memory its budget stands for (L x H_kv x B entries) on some "
            "samples (`over_budget` in leaderboard.csv), so it is not at the budget it is filed under: listed apart, "
            "left out of ranks, verdicts and the headline.", ""]
