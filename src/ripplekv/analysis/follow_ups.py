"""The multi-question protocols' table: how much each method's answers change from the first question to the follow-ups.

One context is compressed once and asked k questions (`pipeline.multi_question`); a method that kept what the first
question needed may have dropped what a later one needs. Per method and budget, and per measure (KL to the full
cache along its answer; the task score), the unit is the context: its first question's value, the mean of its
follow-ups' values, and their paired difference (follow-ups minus first). The difference gets the stratified t
interval and the stratified sign-flip p of `analysis.inference`, Holm-adjusted across the table per measure; the
verdict says "further" / "closer" (KL) or "worse" / "better" (score) only when the adjusted p is below 0.05, else
"tied" (or "underpowered" when the comparison could not have seen the effect the page calls meaningful). The full
cache's row shows its own score change: the follow-ups' questions may simply be harder or easier.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.analysis import inference
from ripplekv.runs.files import REFERENCE

MEASURES = ("kl", "score")
FIRST_INDEX = 1
NO_BUDGET = -1.0  # the full cache's budget while pivoting (a missing key would drop its row)


def has_follow_ups(frame: pd.DataFrame) -> bool:
    """Whether the run's lines ask contexts several questions (the multi-question protocols)."""
    return {"context_id", "question_index"} <= set(frame.columns) and bool((frame["question_index"] > FIRST_INDEX).any())


def per_context(frame: pd.DataFrame, measure: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(first, follow-up) values [rows (method, budget), columns (task, context)] of one measure."""
    keyed = frame.assign(budget=frame["budget"].astype("float").fillna(NO_BUDGET))  # the full cache's row kept
    if measure == "score":
        keyed[measure] = 100 * keyed[measure].astype(float)  # points, as every table of a report
    first = keyed[keyed["question_index"] == FIRST_INDEX]
    later = keyed[keyed["question_index"] > FIRST_INDEX]
    shape = dict(index=["method", "budget"], columns=["task", "context_id"], values=measure, aggfunc="mean")
    rows = pd.MultiIndex.from_frame(keyed[["method", "budget"]].drop_duplicates())
    columns = pd.MultiIndex.from_frame(keyed[["task", "context_id"]].drop_duplicates()).sort_values()
    return (first.pivot_table(**shape).reindex(index=rows, columns=columns),
            later.pivot_table(**shape).reindex(index=rows, columns=columns))


def follow_up_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, budget): per measure the first question's mean, the follow-ups' mean, their difference
    with its interval, p, Holm-adjusted p and verdict, and the contexts counted (`n`)."""
    frame = frame[frame["question_index"].notna()]
    rows = None
    for measure in MEASURES:
        first, later = per_context(frame, measure)
        if rows is None:
            rows = pd.DataFrame(first.index.to_list(), columns=["method", "budget"])
        both = np.isfinite(first.to_numpy(float)) & np.isfinite(later.to_numpy(float))
        a = np.where(both, first.to_numpy(float), np.nan)
        b = np.where(both, later.to_numpy(float), np.nan)
        tasks = np.asarray(pd.factorize(pd.Index([task for task, _ in first.columns]), sort=True)[0], dtype=int)
        change = b - a
        estimate = inference.t_interval(change, tasks)
        p = inference.sign_flip_p(change, tasks)
        if measure == "kl":  # the full cache is the reference: its KL is 0 by definition, nothing to test
            p = np.where(rows["method"].to_numpy() == REFERENCE, np.nan, p)
        adjusted = inference.holm(p)
        detectable = estimate.detectable()
        rows[f"{measure}_first"] = inference.stratified_mean(a, tasks)
        rows[f"{measure}_follow_up"] = inference.stratified_mean(b, tasks)
        rows[f"{measure}_change"] = estimate.point
        rows[f"{measure}_change_low"] = estimate.low
        rows[f"{measure}_change_high"] = estimate.high
        rows[f"{measure}_p"] = p
        rows[f"{measure}_p_holm"] = adjusted
        rows[f"{measure}_verdict"] = [
            inference.verdict(lo, hi, q, lower_is_better=measure == "kl", detectable=d,
                              meaningful=inference.MEANINGFUL[measure])
            for lo, hi, q, d in zip(estimate.low, estimate.high, adjusted, detectable)]
        rows["n"] = both.sum(axis=1)
    rows["budget"] = rows["budget"].where(rows["budget"] != NO_BUDGET).astype("Int64")
    order = {method: rank for rank, method in enumerate(dict.fromkeys(frame["method"]))}
    rows["_order"] = rows["method"].map(order)
    rows = rows.sort_values(["budget", "_order"], na_position="first", kind="stable")
    return rows.drop(columns="_order").reset_index(drop=True)


def follow_up_markdown(table: pd.DataFrame, protocol: str | None = None) -> str:
    """follow_ups.md: the table, one line per (method, budget), with what it measured first."""
    how = {"multi-question": "compressed without any question (question-agnostic)",
           "multi-question-first": "compressed with the first question in the observation window"}.get(protocol or "", "")
    lines = ["## Follow-up questions: one compressed context, several questions", "",
             f"Each context was prefilled once and compressed once{', ' + how if how else ''}; every question was "
             "answered from that one cache. Change = follow-ups' mean minus the first question's, per context "
             "(paired), averaged over tasks; 95% stratified t interval, sign-flip p Holm-adjusted per measure. KL: "
             "\"further\" means the follow-ups stray further from the full cache. `n`: contexts.", "",
             "| method | B | n | KL first | KL follow-ups | KL change [95% CI] | verdict | score first | "
             "score follow-ups | score change [95% CI] | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in table.itertuples(index=False):
        budget = "" if pd.isna(row.budget) else str(int(row.budget))
        kl = _change(row.kl_change, row.kl_change_low, row.kl_change_high, 4)
        score = _change(row.score_change, row.score_change_low, row.score_change_high, 1)
        lines.append(f"| {row.method} | {budget} | {row.n} | {_number(row.kl_first, 4)} | "
                     f"{_number(row.kl_follow_up, 4)} | {kl} | {row.kl_verdict or '-'} | {_number(row.score_first, 1)} | "
                     f"{_number(row.score_follow_up, 1)} | {score} | {row.score_verdict or '-'} |")
    return "\n".join(lines) + "\n"


def _number(value, digits: int) -> str:
    return "-" if pd.isna(value) else f"{value:.{digits}f}"


def _change(point, low, high, digits: int) -> str:
    if pd.isna(point):
        return "-"
    if pd.isna(low):
        return f"{point:+.{digits}f}"
    return f"{point:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def run_protocol(run_dir) -> str | None:
    """The protocol a run's config.json records (None when unreadable)."""
    import json
    from pathlib import Path

    from ripplekv.runs.files import CONFIG

    try:
        config = json.loads((Path(run_dir) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("protocol") if isinstance(config, dict) else None
