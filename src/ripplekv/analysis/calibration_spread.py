"""How much a calibrated method moves with its calibration draw, beside how much it moves with the samples.

A calibrated method (RippleKV's profile and ratio, DepthKV's task-drop allocation, CompressKV's profile, the route)
is calibrated on several disjoint draws of the calibration split and each draw's result is evaluated on the same
evaluation samples (`pipeline.draws`). Per method and budget: draw 0's mean KL with its 95% interval over samples
(the interval the leaderboard gives it), every draw's mean KL, their SD and range across draws, and each draw's
paired KL difference to the uniform baseline with its interval. An SD across draws as large as the interval's
half-width says the calibration draw matters as much as the evaluation samples do; a difference to the baseline
whose sign flips between draws is a finding of one draw, not of the method.

The paired differences come from `pairs.head_to_head` (a task-stratified paired bootstrap); the table's other
columns need nothing from it, so a different paired test drops in there alone.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.analysis import pairs, stats
from ripplekv.defaults import UNIFORM_BASELINES

SUMMARY_COLUMNS = ["method", "budget", "draws", "samples", "kl_draw0", "kl_ci_low", "kl_ci_high", "kl_by_draw",
                   "kl_draw_sd", "kl_draw_min", "kl_draw_max", "sd_over_half_width", "baseline", "kl_delta_by_draw",
                   "draws_lower_than_baseline", "draws_higher_than_baseline", "score_by_draw", "score_draw_sd"]
PER_DRAW_COLUMNS = ["method", "draw", "variant", "budget", "samples", "kl", "score", "baseline", "kl_delta",
                    "kl_delta_ci_low", "kl_delta_ci_high"]


def _baseline(methods) -> str | None:
    present = set(methods)
    return next((name for name in UNIFORM_BASELINES if name in present), None)


def _joined(values, digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def spread(frame: pd.DataFrame, draws: pd.DataFrame, resamples: int = stats.RESAMPLES,
           seed: int = stats.SEED) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary per method and budget, one row per method, draw and budget) from the eval lines of every draw's
    variant (`frame`: draw 0's and the further draws' evals together) and the (method, draw, variant) table.
    Only samples every draw's variant ran are used, so the draws are compared on the same questions."""
    base = _baseline(frame["method"])
    summary, per_draw = [], []
    for method, table in draws.groupby("method", sort=False):
        table = table.sort_values("draw")
        variants = list(table["variant"])
        for budget in sorted(frame.loc[frame["method"] == variants[0], "budget"].dropna().unique()):
            lines = frame[(frame["budget"] == budget) & frame["method"].isin(variants + ([base] if base else []))]
            ran = lines[lines["method"].isin(variants)].groupby(["task", "id"])["method"].nunique()
            shared = ran[ran == ran.max()].index if len(ran) else ran.index
            present = [v for v in variants if (lines["method"] == v).any()]
            if len(present) < 2 or not len(shared):
                continue
            keep = pd.MultiIndex.from_frame(lines[["task", "id"]]).isin(shared)
            lines = lines[keep]
            draw_of = dict(zip(table["variant"], table["draw"]))
            kept = lines[lines["method"].isin(present)].assign(key=lambda t: t["method"])
            boot = stats.Bootstrap.draw(kept, resamples, seed)
            kl, kl_draws = boot.replicates(kept, "kl", present)
            score, _ = boot.replicates(kept, "score", present)
            low, high = stats.interval(kl_draws[0])
            deltas = []
            for index, variant in enumerate(present):
                row = {"method": method, "draw": int(draw_of[variant]), "variant": variant, "budget": int(budget),
                       "samples": len(shared), "kl": float(kl[index]), "score": float(100 * score[index]),
                       "baseline": base, "kl_delta": np.nan, "kl_delta_ci_low": np.nan, "kl_delta_ci_high": np.nan}
                if base is not None and variant != base:
                    versus = pairs.head_to_head(lines, variant, base, resamples, seed)
                    if not versus.empty:
                        first = versus.iloc[0]
                        row.update(kl_delta=float(first["kl_delta"]), kl_delta_ci_low=float(first["kl_ci_low"]),
                                   kl_delta_ci_high=float(first["kl_ci_high"]))
                deltas.append(row)
            per_draw += deltas
            sd = float(np.std(kl, ddof=1))
            half = (high - low) / 2
            summary.append({
                "method": method, "budget": int(budget), "draws": len(present), "samples": len(shared),
                "kl_draw0": float(kl[0]), "kl_ci_low": float(low), "kl_ci_high": float(high),
                "kl_by_draw": _joined(kl, 3), "kl_draw_sd": sd, "kl_draw_min": float(kl.min()),
                "kl_draw_max": float(kl.max()), "sd_over_half_width": sd / half if half > 0 else np.nan,
                "baseline": base, "kl_delta_by_draw": _joined([d["kl_delta"] for d in deltas], 3),
                "draws_lower_than_baseline": sum(d["kl_delta_ci_high"] < 0 for d in deltas),
                "draws_higher_than_baseline": sum(d["kl_delta_ci_low"] > 0 for d in deltas),
                "score_by_draw": _joined(100 * score, 2), "score_draw_sd": float(np.std(100 * score, ddof=1)),
            })
    return pd.DataFrame(summary, columns=SUMMARY_COLUMNS), pd.DataFrame(per_draw, columns=PER_DRAW_COLUMNS)


def spread_markdown(summary: pd.DataFrame) -> str:
    """The summary as a markdown table: draw 0 with its interval, then the draws and their spread."""
    rows = []
    for r in summary.itertuples():
        rows.append({
            "method": f"`{r.method}`", "budget": r.budget,
            "KL, draw 0 [95% CI over samples]": f"{r.kl_draw0:.3f} [{r.kl_ci_low:.3f}, {r.kl_ci_high:.3f}]",
            "KL by draw": r.kl_by_draw, "SD across draws": f"{r.kl_draw_sd:.3f}",
            "range": f"{r.kl_draw_max - r.kl_draw_min:.3f}",
            "SD / CI half-width": f"{r.sd_over_half_width:.2f}" if pd.notna(r.sd_over_half_width) else "n/a",
            f"KL - {r.baseline} by draw": r.kl_delta_by_draw if r.baseline else "n/a",
            "draws below / above it (CI)": f"{r.draws_lower_than_baseline} / {r.draws_higher_than_baseline}",
            "score by draw": r.score_by_draw,
        })
    return pd.DataFrame(rows).to_markdown(index=False) + "\n"
