"""Two methods head to head: their paired score and KL differences at each budget, with intervals and tests.

The leaderboard pairs every method with the uniform baseline; a question like "does GraceKV as published beat
its fixed-slot reading" pairs two methods directly, on the samples both ran (`analysis.inference`: stratified t
interval, sign-flip p, Holm over the table's budgets, per measure).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.analysis import inference, proportions
from ripplekv.analysis.tables import compare

COLUMNS = ["budget", "method", "versus", "samples", "score_delta", "score_ci_low", "score_ci_high", "p_score",
           "p_score_holm", "score_mdd", "kl_delta", "kl_ci_low", "kl_ci_high", "p_kl", "p_kl_holm", "kl_mdd"]


def head_to_head(frame: pd.DataFrame, method: str, versus: str, seed: int = inference.SEED,
                 counted: list[str] | None = None) -> pd.DataFrame:
    """Per budget both methods ran at: `method` minus `versus` (score x 100 over the `counted` tasks, default all;
    KL per answer token), point, 95% interval, p and Holm's p, over the samples both have. Empty when they share no
    budget."""
    accuracy = proportions.accuracy_tasks(frame)  # over the whole run: a task is an accuracy for every pair
    rows = frame[frame["method"].isin([method, versus]) & frame["budget"].notna()]
    rows = rows[rows.groupby(["task", "id", "budget"])["method"].transform("nunique") == 2]
    if rows.empty:
        return pd.DataFrame(columns=COLUMNS)
    budgets = sorted(int(b) for b in rows["budget"].unique())
    keys = [(m, b) for b in budgets for m in (method, versus)]
    number = {key: i for i, key in enumerate(keys)}
    rows = rows.assign(key=[number[(m, int(b))] for m, b in zip(rows["method"], rows["budget"])],
                       score=100 * rows["score"])
    pairs = [(2 * i, 2 * i + 1) for i in range(len(budgets))]
    kl = compare(inference.sample_matrix(rows, "kl", list(range(len(keys))), bounds=(0.0, np.inf)), pairs, seed=seed)
    counted = list(dict.fromkeys(rows["task"])) if counted is None else counted
    chosen = rows[rows["task"].isin(counted)]
    score = compare(inference.sample_matrix(chosen, "score", list(range(len(keys))), accuracy=accuracy,
                                            bounds=(0.0, 100.0)), pairs, seed=seed)
    samples = rows.groupby("budget")["id"].size() // 2
    return pd.DataFrame({
        "budget": budgets, "method": method, "versus": versus, "samples": [int(samples[b]) for b in budgets],
        "score_delta": score["delta"], "score_ci_low": score["low"], "score_ci_high": score["high"],
        "p_score": score["p"], "p_score_holm": score["p_holm"], "score_mdd": score["mdd"],
        "kl_delta": kl["delta"], "kl_ci_low": kl["low"], "kl_ci_high": kl["high"], "p_kl": kl["p"],
        "p_kl_holm": kl["p_holm"], "kl_mdd": kl["mdd"]}, columns=COLUMNS)


def pair_verdict(row, name: str) -> str:
    """The verdict of one measure (`kl` or `score`) of a head_to_head row, `underpowered` where its detectable
    difference exceeds the meaningful one (`inference.MEANINGFUL`)."""
    return inference.verdict(getattr(row, f"{name}_ci_low"), getattr(row, f"{name}_ci_high"),
                             getattr(row, f"p_{name}_holm"), name == "kl", getattr(row, f"{name}_mdd", None),
                             inference.MEANINGFUL[name])


def head_to_head_markdown(table: pd.DataFrame) -> str:
    """The table as markdown, differences with their intervals, p (Holm) and verdict."""
    def line(r, name, digits, lower):
        if pd.isna(getattr(r, f"{name}_delta")):
            return "– (no informative task)" if name == "score" else "–"
        word = pair_verdict(r, name)
        return (f"{getattr(r, f'{name}_delta'):+.{digits}f} [{getattr(r, f'{name}_ci_low'):+.{digits}f}, "
                f"{getattr(r, f'{name}_ci_high'):+.{digits}f}], p {getattr(r, f'p_{name}'):.2g} "
                f"(Holm {getattr(r, f'p_{name}_holm'):.2g}) {word}")

    lines = [{"budget": int(r.budget), "n": int(r.samples),
              f"KL, {r.method} - {r.versus} [95% CI], p": line(r, "kl", 3, True),
              f"score, {r.method} - {r.versus} [95% CI], p": line(r, "score", 2, False)}
             for r in table.itertuples()]
    return pd.DataFrame(lines).to_markdown(index=False, disable_numparse=True) + "\n"
