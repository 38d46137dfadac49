"""Forest plots: per budget, each method's paired comparison with the uniform baseline and its 95% interval,
sorted, so "which methods are closer to the full cache than SnapKV, by how much, how sure" reads off one
picture. They read the leaderboard of `analysis.tables.add_uncertainty`.

KL is drawn as its ratio to the baseline's mean KL (`kl_ratio_vs_uniform`, a paired delta-method interval of
the log ratio) on a log axis with labelled ticks (x0.5, x1, x2, ...), so a method 16% closer and one twice as
far sit at distances that mean what they say. Scores are differences on a linear axis. Every row keeps its
method's colour and marker (`plots.series_styles`); `*` marks a difference significant after Holm's
adjustment. Answer-aware variants are not drawn: they are no methods and no bounds (the tables show them); nor
are rows with fewer samples than the leaderboard's n (`tables.fewer_samples`), which are never ranked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis.plots import pyplot, series_styles
from ripplekv.runs.files import REFERENCE, is_ceiling
from ripplekv.runs.safeio import save_figure

RATIO_TICKS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
FINE_TICKS = (2 / 3, 0.8, 1.25, 1.5)  # added when the axis spans little more than one doubling
# (the point, the interval's columns, Holm p, axis label)
MEASURES = {
    "kl": ("kl_ratio_vs_uniform", "kl_ratio_ci_low", "kl_ratio_ci_high", "p_kl_vs_uniform_holm",
           "KL ÷ {base}'s KL, log scale (95% CI)\n← closer to the full cache"),
    "score": ("delta_vs_uniform", "delta_ci_low", "delta_ci_high", "p_vs_uniform_holm",
              "score − {base}'s score, informative tasks (95% CI)\nbetter →"),
}


def short_label(label: str) -> str:
    """A method label without the options that name a run's file (`depthkv:allocation=depthkv.csv:scorer=snapkv`
    reads `depthkv:scorer=snapkv`): the file is the run's own, and the full label stays in the tables."""
    name, *options = str(label).split(":")
    return ":".join([name, *(o for o in options if not o.partition("=")[2].endswith(".csv"))])


def forest_rows(board: pd.DataFrame, budget, measure: str, ceilings=None) -> tuple[pd.DataFrame, str | None]:
    """At one budget: every compressed method with a comparison (`method, delta, low, high, p_holm`), best at the
    top, answer-aware variants left out (`ceilings`: the run's answer-aware labels; None: by name), and the
    baseline's name (None when the budget has none). For KL, `delta`, `low` and `high` are ratios to the baseline."""
    point, low, high, p_holm, _ = MEASURES[measure]
    empty = pd.DataFrame(columns=["method", "delta", "low", "high", "p_holm"])
    rows = board[(board["budget"] == budget) & (board["method"] != REFERENCE)]
    if point not in rows or rows[point].isna().all() or "versus" not in rows:
        return empty, None
    rows = rows[rows[point].notna() & ~rows["method"].map(lambda m: is_ceiling(m, ceilings)).astype(bool)]
    if "fewer_samples" in rows:  # sorted best first is a ranking: rows on fewer samples are not drawn
        rows = rows[~rows["fewer_samples"].astype(bool)]
    out = pd.DataFrame({"method": rows["method"], "delta": rows[point], "low": rows[low], "high": rows[high],
                        "p_holm": rows[p_holm]})
    out = out.sort_values("delta", ascending=(measure == "kl"), kind="stable")  # best at the top
    return out.reset_index(drop=True), str(rows["versus"].dropna().iloc[0]) if rows["versus"].notna().any() else None


def plot_forest(board: pd.DataFrame, path: Path, measure: str = "kl", ceilings=None, styles=None) -> None:
    """One panel per budget: a row per method, its comparison with the baseline and 95% interval."""
    plt = pyplot()
    styles = styles or series_styles(board.loc[board["method"] != REFERENCE, "method"])
    budgets = sorted(int(b) for b in board["budget"].dropna().unique())
    panels = [(b, *forest_rows(board, b, measure, ceilings)) for b in budgets]
    panels = [p for p in panels if p[2] is not None] or [(None, forest_rows(board.iloc[0:0], None, measure)[0], None)]
    tallest = max(len(p[1]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 1.3 + 0.28 * max(tallest, 3)), squeeze=False)
    for ax, (budget, rows, base) in zip(axes[0], panels):
        y = np.arange(len(rows))[::-1]  # the first row (the best) at the top
        for at, row in zip(y, rows.itertuples()):
            style = styles.get(row.method) or series_styles([row.method])[row.method]
            err = [[max(row.delta - row.low, 0)], [max(row.high - row.delta, 0)]]
            ax.errorbar([row.delta], [at], xerr=err, fmt=style.marker, markersize=5, capsize=2, color=style.colour,
                        markerfacecolor=style.face)
        ax.axvline(1.0 if measure == "kl" else 0.0, color="black", linewidth=0.8)
        labels = [short_label(r.method) + (" *" if pd.notna(r.p_holm) and r.p_holm < 0.05 else "") for r in rows.itertuples()]
        ax.set_yticks(y, labels, fontsize="small")
        ax.set_ylim(-0.7, max(len(rows), 1) - 0.3)
        ax.set_title(f"B={budget}" if budget is not None else "no baseline in this run", fontsize="medium")
        ax.set_xlabel(MEASURES[measure][4].format(base=base or "the baseline"), fontsize="small")
        ax.grid(axis="x", alpha=0.3)
        if measure == "kl" and len(rows):
            ratio_axis(ax, float(rows["low"].min()), float(rows["high"].max()))
    title = "Fidelity: KL relative to" if measure == "kl" else "Score: paired difference to"
    fig.suptitle(f"{title} the uniform baseline, per budget (* significant after Holm's adjustment)", fontsize="medium")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def ratio_ticks(low: float, high: float) -> list[float]:
    """The labelled ticks of a ratio axis from `low` to `high`: powers of 2, and finer steps on a short axis."""
    ticks = [t for t in RATIO_TICKS if low <= t <= high]
    if len(ticks) < 3:
        ticks = sorted(ticks + [t for t in FINE_TICKS if low <= t <= high])
    return ticks or [1.0]


def ratio_axis(ax, low: float, high: float) -> None:
    """A log axis of the KL ratio holding 1, with its ticks written as multiples (x0.5, x1, x2)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    low, high = min(low, 1.0) / 1.15, max(high, 1.0) * 1.15
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ticks = ratio_ticks(low, high)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"×{t:.3g}" for t in ticks], fontsize="x-small")
