"""Forest plots: per budget, each method's paired difference to the uniform baseline with its 95% interval,
sorted, so "which methods are closer to the full cache than SnapKV, by how much, how sure" reads off one
picture. Methods are coloured by family (`defaults.METHOD_FAMILIES`); a ceiling is a dashed line at its
difference, never a ranked row. They read the leaderboard of `analysis.tables.add_uncertainty`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis.plots import pyplot
from ripplekv.analysis.tables import baseline_of
from ripplekv.defaults import METHOD_FAMILIES
from ripplekv.runs.files import REFERENCE, is_ceiling
from ripplekv.runs.safeio import save_figure

OTHER = "other"
KL_LINEAR = 0.1  # the KL axis is linear within +-0.1 of the baseline and logarithmic beyond
# One colour per family (matplotlib's tab10, in the order of METHOD_FAMILIES), grey for the rest.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#7f7f7f")
# (leaderboard value, its difference to the baseline, the interval's columns, axis label, lower is better)
MEASURES = {
    "kl": ("kl", "kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high",
           "KL − {base}'s KL (95% CI)\n← closer to the full cache"),
    "score": ("avg", "delta_vs_uniform", "delta_ci_low", "delta_ci_high", "score − {base}'s score (95% CI)\nbetter →"),
}


def family_of(label: str) -> str:
    """The family of a method label (`ripplekv:split=adakv` is RippleKV's)."""
    preset = str(label).split(":", 1)[0].strip()
    return next((family for family, names in METHOD_FAMILIES.items() if preset in names), OTHER)


def short_label(label: str) -> str:
    """A method label without the options that name a run's file (`depthkv:allocation=depthkv.csv:scorer=snapkv`
    reads `depthkv:scorer=snapkv`): the file is the run's own, and the full label stays in the tables."""
    name, *options = str(label).split(":")
    return ":".join([name, *(o for o in options if not o.partition("=")[2].endswith(".csv"))])


def colours() -> dict[str, str]:
    return {family: PALETTE[i % (len(PALETTE) - 1)] for i, family in enumerate(METHOD_FAMILIES)} | {OTHER: PALETTE[-1]}


def forest_rows(board: pd.DataFrame, budget, measure: str,
                ceilings=None) -> tuple[pd.DataFrame, list[tuple[str, float]], str | None]:
    """At one budget: the methods' differences with intervals (sorted, best at the top), each ceiling's
    difference, and the baseline's name (None when the budget has none). `ceilings`: the run's answer-aware
    labels (`runs.files.run_ceilings`; None: the name rule of runs made before they were recorded)."""
    value, delta, low, high, _ = MEASURES[measure]
    rows = board[(board["budget"] == budget) & (board["method"] != REFERENCE)]
    base = baseline_of(rows["method"])
    if base is None:
        return rows.iloc[0:0], [], None
    base_value = float(rows.loc[rows["method"] == base, value].iloc[0])
    ceiling = rows["method"].map(lambda label: is_ceiling(label, ceilings)).astype(bool)
    ceilings = [(m, float(v) - base_value) for m, v in zip(rows.loc[ceiling, "method"], rows.loc[ceiling, value])]
    ranked = rows[~ceiling & rows[delta].notna()][["method", delta, low, high]]
    ranked = ranked.rename(columns={delta: "delta", low: "low", high: "high"})
    # Best at the top: lowest KL difference, highest score difference.
    ranked = ranked.sort_values("delta", ascending=(measure == "kl"), kind="stable")
    return ranked.reset_index(drop=True), ceilings, base


CEILING_STYLES = ("--", ":", "-.")


def plot_forest(board: pd.DataFrame, path: Path, measure: str = "kl", ceilings=None) -> None:
    """One panel per budget: a row per method, its paired difference to the baseline and 95% interval."""
    plt = pyplot()
    budgets = sorted(int(b) for b in board["budget"].dropna().unique())
    panels = [(b, *forest_rows(board, b, measure, ceilings)) for b in budgets]
    panels = [p for p in panels if p[3] is not None] or [(None, pd.DataFrame(columns=["method", "delta", "low", "high"]), [], None)]
    tallest = max(len(p[1]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 1.2 + 0.28 * max(tallest, 3)), squeeze=False)
    palette = colours()
    seen: dict[str, object] = {}
    styles: dict[str, str] = {}
    for ax, (budget, rows, ceilings, base) in zip(axes[0], panels):
        y = np.arange(len(rows))[::-1]  # the first row (the best) at the top
        for family, group in rows.groupby(rows["method"].map(family_of), sort=False):
            where = y[group.index.to_numpy()]
            err = np.vstack([(group["delta"] - group["low"]).clip(lower=0), (group["high"] - group["delta"]).clip(lower=0)])
            seen[family] = ax.errorbar(group["delta"], where, xerr=err, fmt="o", markersize=4, capsize=2,
                                       color=palette[family], label=family)
        ax.axvline(0, color="black", linewidth=0.8)
        for name, offset in ceilings:  # one line style each, the same in every panel, so two ceilings read apart
            style = styles.setdefault(name, CEILING_STYLES[len(styles) % len(CEILING_STYLES)])
            seen[f"{name} (ceiling)"] = ax.axvline(offset, color="grey", linestyle=style, linewidth=1.2,
                                                   label=f"{name} (ceiling)")
        ax.set_yticks(y, [short_label(m) for m in rows["method"]], fontsize="small")
        ax.set_ylim(-0.7, max(len(rows), 1) - 0.3)
        ax.set_title(f"B={budget}" if budget is not None else "no baseline in this run", fontsize="medium")
        ax.set_xlabel(MEASURES[measure][4].format(base=base or "the baseline"), fontsize="small")
        ax.grid(axis="x", alpha=0.3)
        if measure == "kl":  # linear near 0, where methods differ by hundredths; compressed for outliers
            ax.set_xscale("symlog", linthresh=KL_LINEAR)
    if seen:  # below the panels, never over the data
        fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(len(seen), 4), fontsize="small",
                   frameon=False, bbox_to_anchor=(0.5, 0.0))
    title = "Fidelity: paired KL difference" if measure == "kl" else "Score: paired difference"
    fig.suptitle(f"{title} to the uniform baseline, per budget", fontsize="medium")
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(seen) // 4), 1, 1))
    save_figure(fig, path, dpi=110)
    plt.close(fig)
