"""Variants that keep more than their budget: a method that spends more than the memory B stands for
(`L x H_kv x B` full-precision entries on the prompt) by design, such as kvpress's rounding of LU-KV
(`lukv:rounding=kvpress`) or GraceKV's `ends=free`, is not at the budget it is filed under. Ranking it beside
the exact methods would reward the extra memory, so reports flag it (`over_budget`) and leave it out of ranks,
verdicts and the headline, as they do the answer-aware ceilings; its numbers stay in the tables, shown apart.

A threshold variant (`METHOD:threshold=TAU`, SimLayerKV's `reading=threshold`: `methods.core.thresholded`) keeps
what scores above tau, so its memory varies per prompt and is at no budget, even on prompts where it keeps less:
it is flagged the same way whatever it kept (verdict `threshold`), and the memory axis places it at the bytes it
spent (`analysis.memory_axis`)."""

from __future__ import annotations

import pandas as pd

from ripplekv.defaults import THRESHOLD

COLUMN = "over_budget"
THRESHOLD_VERDICT = THRESHOLD_COLUMN = THRESHOLD  # the verdict, and a column on a board with a threshold variant


def spends_by_threshold(spec: dict) -> bool:
    """Whether a resolved spec (`describe()`, as config.json records it) keeps what passes a threshold, so its
    memory varies per prompt: the `threshold=` option, or SimLayerKV's kvpress reading (`reading=threshold`)."""
    allocator = spec.get("allocator")
    return THRESHOLD in spec or (isinstance(allocator, dict) and allocator.get("reading") == THRESHOLD)


def over_budget(frame: pd.DataFrame) -> frozenset[str]:
    """Labels of the methods that kept more bytes than the budget stands for on some sample (`kv_bytes` over
    `kv_budget_bytes`, which every eval line has; older lines without them never count)."""
    if not {"kv_bytes", "kv_budget_bytes"} <= set(frame.columns):
        return frozenset()
    kept = pd.to_numeric(frame["kv_bytes"], errors="coerce")
    allowed = pd.to_numeric(frame["kv_budget_bytes"], errors="coerce")
    return frozenset(str(method) for method in frame.loc[kept > allowed, "method"].unique())


def thresholded(specs: dict) -> frozenset[str]:
    """Labels of the run's threshold variants, from its resolved specs (label -> `describe()`, config.json's)."""
    return frozenset(label for label, spec in specs.items() if isinstance(spec, dict) and spends_by_threshold(spec))


def flag(board: pd.DataFrame, labels, thresholds=frozenset()) -> pd.DataFrame:
    """`board` with the `over_budget` column last (True on every row of a flagged method: `labels`, over their
    budget, or `thresholds`, at none), and its verdicts saying which (the tables leave unranked rows unjudged
    under the ceilings' word)."""
    methods = board["method"].astype(str)
    flagged = methods.isin(set(labels) | set(thresholds))
    board = board.drop(columns=[COLUMN, THRESHOLD_COLUMN], errors="ignore")
    for verdict in ("kl_verdict", "verdict"):
        if verdict in board:
            unjudged = flagged & board[verdict].eq("answer-aware")
            board.loc[unjudged, verdict] = "over budget"
            board.loc[unjudged & methods.isin(set(thresholds)), verdict] = THRESHOLD_VERDICT
    board[COLUMN] = flagged
    if thresholds:
        board[THRESHOLD_COLUMN] = methods.isin(set(thresholds))
    return board


def shown(view: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard for reading: the flag right after `rank` when some row is over budget, else not shown."""
    if COLUMN not in view:
        return view
    flagged = view.pop(COLUMN).astype(bool)
    by_threshold = view.pop(THRESHOLD_COLUMN).astype(bool) if THRESHOLD_COLUMN in view else flagged & False
    if flagged.any():
        words = flagged.map({True: "yes", False: ""})
        words[by_threshold] = THRESHOLD_VERDICT  # at no budget, whatever it kept
        view.insert(view.columns.get_loc("rank") + 1 if "rank" in view else 0, "over budget", words)
    return view


def note(labels, present, thresholds=frozenset()) -> list[str]:
    """summary.md's lines naming the flagged methods present in a table (none: no lines); `thresholds` (of
    `labels`) are named as threshold variants."""
    marked = [m for m in dict.fromkeys(map(str, present)) if m in set(labels)]
    by_threshold = [m for m in marked if m in set(thresholds)]
    lines = []
    if by_threshold:
        names = ", ".join(f"`{m}`" for m in by_threshold)
        lines += [f"Threshold: {names} kept what scored above a threshold, so the memory spent varies per prompt and "
                  "is at no budget: listed apart, left out of ranks, verdicts and the headline; the memory axis "
                  "(memory_axis.md) places each at the bytes it spent (mean and range over samples).", ""]
    marked = [m for m in marked if m not in set(thresholds)]
    if not marked:
        return lines
    names = ", ".join(f"`{m}`" for m in marked)
    return lines + [f"Over budget: {names} kept more than the memory its budget stands for (L x H_kv x B entries) on some "
            "samples (`over_budget` in leaderboard.csv), so it is not at the budget it is filed under: listed apart, "
            "left out of ranks, verdicts and the headline.", ""]
