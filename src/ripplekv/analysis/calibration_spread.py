"""How much a calibrated method moves with its calibration draw, beside how much it moves with the samples.

A calibrated method (RippleKV's profile and ratio, DepthKV's task-drop allocation, CompressKV's profile, the route)
is calibrated on several disjoint draws of the calibration split and each draw's result is evaluated on the same
evaluation samples (`pipeline.draws`). Per method and budget, on the samples every draw ran: draw 0's mean KL with
its 95% interval over samples (the leaderboard's stratified t interval, `analysis.inference`), every draw's mean
KL, their SD and range across draws, and each draw's paired KL difference to the uniform baseline (t interval,
sign-flip p, Holm over the method's draws: `tables.compare`) with its verdict. An SD across draws as large as the
interval's half-width says the calibration draw matters as much as the evaluation samples do; a verdict that
changes between draws is a finding of one draw, not of the method.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.analysis import inference
from ripplekv.analysis.tables import compare
from ripplekv.defaults import UNIFORM_BASELINES

SUMMARY_COLUMNS = ["method", "budget", "draws", "samples", "kl_draw0", "kl_ci_low", "kl_ci_high", "kl_by_draw",
                   "kl_draw_sd", "kl_draw_min", "kl_draw_max", "sd_over_half_width", "baseline", "kl_delta_by_draw",
                   "verdict_by_draw", "draws_closer", "draws_further", "score_by_draw", "score_draw_sd"]
PER_DRAW_COLUMNS = ["method", "draw", "variant", "budget", "samples", "kl", "score", "baseline", "kl_delta",
                    "kl_delta_ci_low", "kl_delta_ci_high", "p_kl", "p_kl_holm", "verdict"]


def _baseline(methods) -> str | None:
    present = set(methods)
    return next((name for name in UNIFORM_BASELINES if name in present), None)


def _joined(values, digits: int) -> str:
    return " / ".join("–" if pd.isna(v) else f"{v:.{digits}f}" for v in values)


def spread(frame: pd.DataFrame, draws: pd.DataFrame, seed: int = inference.SEED) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary per method and budget, one row per method, draw and budget) from the eval lines of every draw's
    variant (`frame`: draw 0's and the further draws' evals together) and the (method, draw, variant) table.
    Only samples every draw's variant ran are used, so the draws are compared on the same questions."""
    base = _baseline(frame["method"])
    summary, per_draw = [], []
    for method, table in draws.groupby("method", sort=False):
        table = table.sort_values("draw")
        draw_of = dict(zip(table["variant"], table["draw"]))
        for budget in sorted(frame.loc[frame["method"] == table["variant"].iloc[0], "budget"].dropna().unique()):
            lines = frame[frame["budget"] == budget]
            present = [v for v in table["variant"] if (lines["method"] == v).any()]
            if len(present) < 2:
                continue
            ran = lines[lines["method"].isin(present)].groupby(["task", "id"])["method"].nunique()
            shared = set(ran[ran == len(present)].index)
            keys = present + ([base] if base else [])
            lines = lines[lines["method"].isin(keys) & np.array([key in shared for key in zip(lines["task"], lines["id"])], dtype=bool)]
            if lines.empty:
                continue
            lines = lines.assign(key=lines["method"])
            kl = inference.sample_matrix(lines, "kl", keys, bounds=(0.0, np.inf))
            score = inference.sample_matrix(lines.assign(score=100 * lines["score"]), "score", keys)
            means = inference.stratified_mean(kl.values[: len(present)], kl.tasks)
            scores = inference.stratified_mean(score.values[: len(present)], score.tasks)
            first = inference.t_interval(kl.values[0], kl.tasks)
            versus = (compare(kl, [(i, len(present)) for i in range(len(present))], seed=seed) if base
                      else pd.DataFrame(index=range(len(present)), columns=["delta", "low", "high", "p", "p_holm"]))
            rows = []
            for i, variant in enumerate(present):
                c = versus.iloc[i]
                rows.append({"method": method, "draw": int(draw_of[variant]), "variant": variant, "budget": int(budget),
                             "samples": len(shared), "kl": float(means[i]), "score": float(scores[i]),
                             "baseline": base, "kl_delta": c["delta"], "kl_delta_ci_low": c["low"],
                             "kl_delta_ci_high": c["high"], "p_kl": c["p"], "p_kl_holm": c["p_holm"],
                             "verdict": inference.verdict(c["low"], c["high"], c["p_holm"], True, c.get("mdd"),
                                                          inference.MEANINGFUL["kl"])})
            per_draw += rows
            sd = float(np.std(means, ddof=1))
            half = float(first.high[0] - first.low[0]) / 2
            summary.append({
                "method": method, "budget": int(budget), "draws": len(present), "samples": len(shared),
                "kl_draw0": float(means[0]), "kl_ci_low": max(float(first.low[0]), 0.0), "kl_ci_high": float(first.high[0]),
                "kl_by_draw": _joined(means, 3), "kl_draw_sd": sd, "kl_draw_min": float(means.min()),
                "kl_draw_max": float(means.max()), "sd_over_half_width": sd / half if half > 0 else np.nan,
                "baseline": base, "kl_delta_by_draw": _joined([r["kl_delta"] for r in rows], 3),
                "verdict_by_draw": " / ".join(r["verdict"] or "–" for r in rows),
                "draws_closer": sum(r["verdict"] == "closer" for r in rows),
                "draws_further": sum(r["verdict"] == "further" for r in rows),
                "score_by_draw": _joined(scores, 2), "score_draw_sd": float(np.std(scores, ddof=1)),
            })
    return pd.DataFrame(summary, columns=SUMMARY_COLUMNS), pd.DataFrame(per_draw, columns=PER_DRAW_COLUMNS)


def spread_markdown(summary: pd.DataFrame) -> str:
    """The summary as a markdown table: draw 0 with its interval, then the draws and their spread (and each draw
    against the baseline where the draws' run has one: a run of calibrated rows alone gets no such column)."""
    rows = []
    for r in summary.itertuples():
        versus = ({f"KL - {r.baseline} by draw (Holm over draws)": f"{r.kl_delta_by_draw} ({r.verdict_by_draw})"}
                  if isinstance(r.baseline, str) else {})
        rows.append({
            "method": f"`{r.method}`", "budget": r.budget, "samples": r.samples,
            "KL, draw 0 [95% CI over samples]": f"{r.kl_draw0:.3f} [{r.kl_ci_low:.3f}, {r.kl_ci_high:.3f}]",
            "KL by draw": r.kl_by_draw, "SD across draws": f"{r.kl_draw_sd:.3f}",
            "range": f"{r.kl_draw_max - r.kl_draw_min:.3f}",
            "SD / CI half-width": f"{r.sd_over_half_width:.2f}" if pd.notna(r.sd_over_half_width) else "n/a",
            **versus, "score by draw": r.score_by_draw,
        })
    return pd.DataFrame(rows).fillna("n/a").to_markdown(index=False) + "\n"
