"""Per budget, whose follow-up answers hold best: the multi-question protocols' headline, against the runner-up.

A method "holds" when its answers to the follow-up questions stay close to the full cache's (fidelity first): the
measure is the follow-up KL, per context the mean over its follow-ups, then the mean over tasks of per-task means
(`analysis.follow_ups`). Per budget the candidates are the methods other than the full cache with a value on every
context. Two readings of "the best", because a best chosen in hindsight flatters itself (docs: a best-of is a
bound on selectors, never judged on the data that chose it):
- in sample: the lowest and second-lowest follow-up KL over every context are named best and runner-up, and their
  paired difference (best minus runner-up) is tested. The pair was picked on these data, so a `closer` here is
  weaker evidence than its p says; a `tied` stands (`analysis.headline`'s rule, disclosed on the page).
- held out (cross-fit): the contexts are split in two halves (alternately within each task, in id order); each
  half is judged on the pair the *other* half picked, so no context judges a pick it made. That difference tests
  the selection rule: `closer` says that the method picked on some contexts holds better on others.
Each comparison has the stratified t interval and the stratified sign-flip p of `analysis.inference`,
Holm-adjusted across the table's rows per kind; `closer` / `further` only at adjusted p < 0.05 with the interval
excluding 0, else `tied`, or `underpowered` where the minimum detectable difference exceeds the meaningful KL
effect. Beside it the drop of both methods (follow-ups' KL minus the first question's, paired by context; Holm
across the table's drops) and the follow-up scores of both and of the full cache.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.analysis import inference
from ripplekv.analysis.follow_ups import NO_BUDGET, per_context
from ripplekv.runs.files import REFERENCE

VARIANTS = {"multi-question": "question-agnostic", "multi-question-first": "first question in the window"}
KINDS = ("in_sample", "held_out", "best_drop", "runner_up_drop")  # each a Holm family across the table


def _pick(values: np.ndarray, tasks: np.ndarray, columns: np.ndarray) -> tuple[int, int]:
    """(best, runner-up) rows: the two lowest stratified means over `columns` (ties: the earlier row)."""
    means = inference.stratified_mean(np.where(columns, values, np.nan), tasks)
    best, runner = np.argsort(means, kind="stable")[:2]
    return int(best), int(runner)


def halves(tasks: np.ndarray) -> np.ndarray:
    """0 or 1 per context: alternately within each task, in the order given (id order)."""
    half = np.zeros(len(tasks), dtype=int)
    for task in np.unique(tasks):
        where = np.flatnonzero(tasks == task)
        half[where] = np.arange(len(where)) % 2
    return half


def _tested(difference: np.ndarray, tasks: np.ndarray, prefix: str) -> dict:
    """Point, interval, detectable difference and raw p of one row of paired differences."""
    estimate = inference.t_interval(difference, tasks)
    return {prefix: estimate.point[0], f"{prefix}_low": estimate.low[0], f"{prefix}_high": estimate.high[0],
            f"{prefix}_mdd": estimate.detectable()[0], f"{prefix}_p": inference.sign_flip_p(difference, tasks)[0]}


def _budget_row(first: pd.DataFrame, later: pd.DataFrame, scores: pd.DataFrame, budget, tasks: np.ndarray) -> dict | None:
    rows = [key for key in later.index if key[1] == budget and key[0] != REFERENCE]
    block = later.loc[rows].to_numpy(float)
    seen = np.isfinite(block).any(axis=0)
    complete = [i for i in range(len(rows)) if np.isfinite(block[i, seen]).all()]
    if len(complete) < 2:
        return None
    rows, block = [rows[i] for i in complete], block[complete][:, seen]
    tasks = tasks[seen]
    best, runner = _pick(block, tasks, np.ones(len(tasks), dtype=bool))
    row = {"budget": int(budget), "n": int(seen.sum()), "tasks": len(np.unique(tasks)), "candidates": len(rows),
           "best": rows[best][0], "runner_up": rows[runner][0],
           "best_kl": inference.stratified_mean(block[best], tasks)[0],
           "runner_up_kl": inference.stratified_mean(block[runner], tasks)[0]}
    row.update(_tested(block[best] - block[runner], tasks, "in_sample"))
    half, held, pairs = halves(tasks), np.full(len(tasks), np.nan), []
    if min(np.bincount(half, minlength=2)) >= 2:  # each half needs contexts to pick on and to be judged on
        for judged in (0, 1):
            b, r = _pick(block, tasks, half != judged)
            held[half == judged] = (block[b] - block[r])[half == judged]
            pairs.append(f"{rows[b][0]} vs {rows[r][0]}")
    row["held_out_pairs"] = "; ".join(pairs)
    row.update(_tested(held, tasks, "held_out") if pairs else {})
    firsts = first.loc[rows].to_numpy(float)[:, seen]
    for name, index in (("best", best), ("runner_up", runner)):
        row[f"{name}_kl_first"] = inference.stratified_mean(firsts[index], tasks)[0]
        row.update(_tested(block[index] - firsts[index], tasks, f"{name}_drop"))
        row[f"{name}_score"] = inference.stratified_mean(scores.loc[[rows[index]]].to_numpy(float)[:, seen], tasks)[0]
    full = [key for key in scores.index if key[0] == REFERENCE]
    row["full_score"] = (inference.stratified_mean(scores.loc[full[:1]].to_numpy(float)[:, seen], tasks)[0]
                         if full else np.nan)
    return row


def variant_rows(frame: pd.DataFrame, protocol: str) -> list[dict]:
    """One row per budget of one run's lines (raw p-values; `holding_table` adjusts them)."""
    frame = frame[frame["question_index"].notna()]
    first, later = per_context(frame, "kl")
    _, scores = per_context(frame, "score")
    tasks = np.asarray(pd.factorize(pd.Index([task for task, _ in later.columns]), sort=True)[0], dtype=int)
    found = []
    for budget in sorted({budget for _, budget in later.index if budget != NO_BUDGET}):
        row = _budget_row(first, later, scores, budget, tasks)
        if row is not None:
            found.append({"protocol": protocol, "variant": VARIANTS.get(protocol, protocol), **row})
    return found


def holding_table(runs: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per (protocol, budget) of `runs` (protocol -> that run's lines): best and runner-up on follow-ups, the
    in-sample and held-out comparisons and both drops, each kind's p Holm-adjusted across the table, verdicts."""
    table = pd.DataFrame([row for protocol, frame in runs.items() for row in variant_rows(frame, protocol)])
    if table.empty:
        return table
    for kind in KINDS:
        if f"{kind}_p" not in table:
            table[[kind, f"{kind}_low", f"{kind}_high", f"{kind}_mdd", f"{kind}_p"]] = np.nan
        table[f"{kind}_p_holm"] = inference.holm(table[f"{kind}_p"].to_numpy(float))
        table[f"{kind}_verdict"] = [
            inference.verdict(lo, hi, q, lower_is_better=True, detectable=d, meaningful=inference.MEANINGFUL["kl"])
            for lo, hi, q, d in zip(table[f"{kind}_low"], table[f"{kind}_high"], table[f"{kind}_p_holm"],
                                    table[f"{kind}_mdd"])]
    return table


def _paired(point, low, high) -> str:
    if pd.isna(point):
        return "–"
    return f"{point:+.4f}" if pd.isna(low) else f"{point:+.4f} [{low:+.4f}, {high:+.4f}]"


def _p(raw, adjusted) -> str:
    return "–" if pd.isna(raw) else f"{raw:.2g} (Holm {adjusted:.2g})"


def _score(value) -> str:
    return "–" if pd.isna(value) else f"{value:.1f}"


def holding_markdown(table: pd.DataFrame) -> str:
    """The table as two markdown tables: who holds best (in sample and held out), then each one's drop."""
    if table.empty:
        return "No budget had two methods with a follow-up KL on every context.\n"
    verdict = lambda value: value or "–"  # noqa: E731
    winners = [{"protocol": r.variant, "B": r.budget, "n": r.n,
                "holds best (follow-up KL)": f"`{r.best}` {r.best_kl:.4f}",
                "runner-up": f"`{r.runner_up}` {r.runner_up_kl:.4f}",
                "best − runner-up [95% CI]": _paired(r.in_sample, r.in_sample_low, r.in_sample_high),
                "p": _p(r.in_sample_p, r.in_sample_p_holm), "verdict (picked on these data)": verdict(r.in_sample_verdict),
                "held out: pair picked on the other half": r.held_out_pairs or "–",
                "held-out difference [95% CI]": _paired(r.held_out, r.held_out_low, r.held_out_high),
                "held-out p": _p(r.held_out_p, r.held_out_p_holm), "held-out verdict": verdict(r.held_out_verdict)}
               for r in table.itertuples()]
    drops = [{"protocol": r.variant, "B": r.budget, "n": r.n,
              "best: KL first → follow-ups": f"`{r.best}` {r.best_kl_first:.4f} → {r.best_kl:.4f}",
              "its change [95% CI], verdict": f"{_paired(r.best_drop, r.best_drop_low, r.best_drop_high)} "
                                            f"{verdict(r.best_drop_verdict)}",
              "runner-up: KL first → follow-ups": f"`{r.runner_up}` {r.runner_up_kl_first:.4f} → {r.runner_up_kl:.4f}",
              "its change [95% CI], verdict ": f"{_paired(r.runner_up_drop, r.runner_up_drop_low, r.runner_up_drop_high)} "
                                             f"{verdict(r.runner_up_drop_verdict)}",
              "follow-up score: best / runner-up / full": f"{_score(r.best_score)} / {_score(r.runner_up_score)} / "
                                                          f"{_score(r.full_score)}"}
             for r in table.itertuples()]
    return (pd.DataFrame(winners).to_markdown(index=False, disable_numparse=True) + "\n\n"
            + pd.DataFrame(drops).to_markdown(index=False, disable_numparse=True) + "\n")


HOW = ("Per budget, the method whose follow-up answers stay closest to the full cache's (lowest follow-up KL) "
       "against the runner-up, best minus runner-up paired by context. In sample: the pair picked on these same "
       "contexts (so a `closer` there is weaker evidence than its p says; a `tied` stands). Held out: the contexts "
       "split in two halves alternately within each task, each half judged on the pair the other half picked (it "
       "needs at least 2 contexts a half: `–` below 4). "
       "95% stratified t intervals; sign-flip p, Holm-adjusted across the table per kind; `closer` only at adjusted "
       "p < 0.05 with the interval excluding 0, else `tied` or `underpowered` (could not have seen a KL difference "
       f"of {inference.MEANINGFUL['kl']}). Change: follow-ups' KL minus the first question's (`further`: the "
       "follow-ups stray further). Scores x100 on the follow-ups; the full cache's says how answerable they are in "
       "that variant's prompts (with the first question in the window, a follow-up is read after the first "
       "question's whole prompt). `n`: contexts.")


def holding_section(frame: pd.DataFrame, protocol: str | None) -> str:
    """follow_ups.md's closing section for one run: whose follow-ups hold best, per budget."""
    table = holding_table({protocol or "": frame})
    return "\n## Whose follow-up answers hold best\n\n" + HOW + "\n\n" + holding_markdown(table)
