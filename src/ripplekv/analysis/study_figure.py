"""The study's factorial effects as one picture: per budget, every effect's KL difference and 95% interval, the
band of differences smaller than the meaningful effect shaded, and the colour its verdict (closer, further, or
neither). Each row is labelled with its table id (`F-128-4`), so a point on the figure is a row on the page.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ripplekv.analysis.plots import pyplot
from ripplekv.runs.safeio import save_figure

FIGURE = "factorial_effects.png"
COLOURS = {"closer": "#1b7837", "further": "#b2182b"}  # anything else (tied, underpowered) is grey
NEITHER = "#7f7f7f"


def plot_effects(effects: pd.DataFrame, path: Path, meaningful: float) -> None:
    """One panel per budget of `effects` (the factorial table with ids), a row per effect in table order, top
    first; the panels share the rows, labelled once on the left with their number (row i is `F-B-i`)."""
    plt = pyplot()
    budgets = sorted(int(b) for b in effects["budget"].unique())
    names = list(dict.fromkeys(effects["effect"]))
    place = {name: len(names) - 1 - i for i, name in enumerate(names)}  # the first effect at the top
    fig, axes = plt.subplots(1, max(len(budgets), 1), figsize=(3.2 + 3.4 * max(len(budgets), 1), 1.5 + 0.3 * len(names)),
                             squeeze=False, sharey=True)
    for ax, budget in zip(axes[0], budgets):
        ax.axvspan(-meaningful, meaningful, color="#e8e8e8", zorder=0)
        ax.axvline(0.0, color="black", linewidth=0.8)
        for row in effects[effects["budget"] == budget].itertuples():
            colour = COLOURS.get(row.verdict, NEITHER)
            err = [[max(row.delta - row.ci_low, 0)], [max(row.ci_high - row.delta, 0)]]
            ax.errorbar([row.delta], [place[row.effect]], xerr=err, fmt="o", markersize=4, capsize=2, color=colour)
        ax.set_title(f"B={budget} (row i: F-{budget}-i)", fontsize="medium")
        ax.set_xlabel("KL difference (95% CI)\n← closer to the full cache", fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks([place[n] for n in names], [f"{i + 1}. {n}" for i, n in enumerate(names)], fontsize="x-small")
    axes[0][0].set_ylim(-0.7, len(names) - 0.3)
    fig.suptitle(f"Factorial effects (green closer, red further, grey neither; shaded: smaller than the "
                 f"meaningful {meaningful:g})", fontsize="medium")
    fig.tight_layout()
    save_figure(fig, path, dpi=110, bbox_inches="tight")  # the longest row label stays whole
    plt.close(fig)
