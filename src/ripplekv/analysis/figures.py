"""The report's plots: score and KL against budget, one line per method with its intervals, and the
per-layer budgets of a prompt of typical length. They read the tables of `analysis.tables` (or the
result lines) and write PNGs through `runs.safeio`. Each method keeps its look (`plots.series_styles`)
across the plots; answer-aware variants are grey and hollow, labelled as such, never drawn as bounds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis.plots import AWARE_COLOUR, pyplot, series_styles
from ripplekv.runs.files import REFERENCE, is_ceiling
from ripplekv.runs.safeio import save_figure

KL_FLOOR = 1e-8  # kl of a variant that keeps everything can be 0; a log axis needs a floor
AWARE = "answer-aware"


_pyplot = pyplot


def score_column(board: pd.DataFrame) -> tuple[str, str]:
    """(the column the score plots show, its name): the informative tasks' average when the run has one."""
    if "avg_informative" in board and board["avg_informative"].notna().any():
        return "avg_informative", "average score, informative tasks (95% CI)"
    return "avg", "average score, all tasks (95% CI)"


def plot_score_vs_budget(board: pd.DataFrame, path: Path, ceilings=None, styles=None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    column, label = score_column(board)
    _method_lines(ax, board, column, ceilings=ceilings, styles=styles)
    full = board[board["method"] == REFERENCE]
    if len(full) and pd.notna(full[column].iloc[0]):
        ax.axhline(float(full[column].iloc[0]), color="black", linestyle="--", linewidth=1, label="full (reference)")
        if f"{column}_ci_low" in full:
            ax.axhspan(float(full[f"{column}_ci_low"].iloc[0]), float(full[f"{column}_ci_high"].iloc[0]), color="black", alpha=0.07)
    _budget_axis(ax, board)
    ax.set_ylabel(label)
    ax.set_title("Score vs KV budget")
    _legend_beside(ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_kl_vs_budget(board: pd.DataFrame, path: Path, ceilings=None, styles=None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    _method_lines(ax, board, "kl", floor=KL_FLOOR, ceilings=ceilings, styles=styles)
    ax.set_yscale("log")
    _plain_log_labels(ax.yaxis)
    _budget_axis(ax, board)
    ax.set_ylabel("KL(full || variant) per answer token, log scale (95% CI)")
    ax.set_title("Fidelity to the full cache vs KV budget")
    _legend_beside(ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _plain_log_labels(axis) -> None:
    """Log-axis labels as plain text (`6e-01`): the default's mathtext took half of this plot's time."""
    from matplotlib.ticker import LogFormatter

    axis.set_major_formatter(LogFormatter())
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _method_lines(ax, board: pd.DataFrame, column: str, floor: float | None = None, ceilings=None, styles=None) -> None:
    """One line per compressed method: `column` against budget, with its `_ci_low/_ci_high` as error bars, in
    its own colour, marker and line style; answer-aware variants (`runs.files.is_ceiling`) grey and hollow."""
    compressed = board[board["method"] != REFERENCE]
    styles = styles or series_styles(compressed["method"])
    count = compressed["method"].nunique()
    for i, (method, group) in enumerate(compressed.groupby("method", sort=False)):
        dodge = 2 ** (0.04 * (i - (count - 1) / 2))  # side by side on the log2 axis, so the bars stay apart
        group = group.sort_values("budget")
        value = group[column].astype(float).clip(lower=floor)
        if value.isna().all():
            continue
        yerr = None
        if f"{column}_ci_low" in group:
            low = group[f"{column}_ci_low"].astype(float).clip(lower=floor)
            high = group[f"{column}_ci_high"].astype(float).clip(lower=floor)
            yerr = np.vstack([(value - low).clip(lower=0), (high - value).clip(lower=0)])
        style = styles[method]
        aware = is_ceiling(method, ceilings)
        ax.errorbar(group["budget"].astype(int) * dodge, value, yerr=yerr, marker=style.marker, linestyle=style.line,
                    capsize=3, color=AWARE_COLOUR if aware else style.colour, markerfacecolor="white" if aware else style.face,
                    label=f"{method} ({AWARE})" if aware else method)


def _legend_beside(ax) -> None:
    """The legend right of the axes, never over the data (a run often compares twenty methods)."""
    count = len(ax.get_legend_handles_labels()[1])
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              ncol=1 if count <= 18 else 2)


def _budget_axis(ax, board: pd.DataFrame) -> None:
    budgets = sorted(int(b) for b in board["budget"].dropna().unique())
    if len(budgets) > 1:
        ax.set_xscale("log", base=2)
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget B (entries per layer per KV head)")
    ax.grid(alpha=0.3)


def typical_sample(frame: pd.DataFrame) -> tuple[str, str]:
    """(task, id) of the sample with the median prompt length (the lower one for an even count)."""
    samples = frame.drop_duplicates(["task", "id"]).sort_values(["prompt_tokens", "task", "id"], kind="stable")
    pick = samples.iloc[(len(samples) - 1) // 2]
    return pick["task"], pick["id"]


def shared_lines(rows: pd.DataFrame) -> dict[tuple, list[str]]:
    """Per-layer budgets -> the methods that have them: methods with identical budgets (snapkv and
    streamingllm are both uniform) get one line and one label, instead of one line hiding the other."""
    lines: dict[tuple, list[str]] = {}
    for values, method in zip(rows["layer_budgets"], rows["method"]):
        lines.setdefault(tuple(int(v) for v in values), []).append(method)
    return lines


def plot_layer_budgets(frame: pd.DataFrame, path: Path) -> None:
    """Per-layer budgets of each method at each budget, for a prompt of typical length: one heat map per
    budget (a row per distinct allocation, a column per layer, the colour its share of B on a log scale, white
    at B), stacked so that every panel reads against the same layer axis."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    from ripplekv.analysis.forest import short_label

    task, sid = typical_sample(frame)
    rows = frame[(frame["task"] == task) & (frame["id"] == sid) & (frame["method"] != REFERENCE)]
    budgets = sorted(int(b) for b in rows["budget"].dropna().unique()) or [0]
    panels = [(budget, shared_lines(rows[rows["budget"] == budget])) for budget in budgets]
    heights = [max(len(lines), 1) for _, lines in panels]
    gap = 0.6  # inches between panels: a panel's title below the layer numbers above it
    height = 1.1 + 0.24 * sum(heights) + gap * len(panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.5, height), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    fig.subplots_adjust(top=1 - 0.55 / height, bottom=0.5 / height, hspace=gap * len(panels) / (0.24 * sum(heights)))
    n = int(rows["prompt_tokens"].iloc[0]) if len(rows) else 0
    norm = TwoSlopeNorm(vmin=-3.0, vcenter=0.0, vmax=3.0)  # log2 of the share of B: x1/8 .. x8
    image = None
    for ax, (budget, lines) in zip(axes[:, 0], panels):
        grid = np.array([list(values) for values in lines], dtype=float).reshape(len(lines), -1)
        shares = np.log2(np.clip(grid / max(budget, 1), 2.0**-3, 2.0**3)) if grid.size else grid
        image = ax.imshow(shares, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        ax.set_yticks(range(len(lines)), [_joined(names, short_label) for names in lines.values()], fontsize="x-small")
        ax.set_title(f"B={budget}", fontsize="small", loc="left")
        ax.tick_params(axis="x", labelsize="x-small")
    axes[-1, 0].set_xlabel("layer")
    if image is not None:
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.025, pad=0.01, ticks=[-3, -2, -1, 0, 1, 2, 3])
        bar.ax.set_yticklabels(["<=1/8", "1/4", "1/2", "1", "2", "4", ">=8"], fontsize="x-small")
        bar.set_label("entries kept per KV head, x B", fontsize="small")
    fig.suptitle(f"Per-layer budgets, prompt of median length ({task}, {sid}, n={n})", fontsize="medium", y=1 - 0.15 / height)
    save_figure(fig, path, dpi=110, bbox_inches="tight")  # the row labels' width varies with the methods
    plt.close(fig)


def _joined(names: list[str], short, most: int = 3) -> str:
    """Methods that share one allocation, as one row label: the first few, then how many more."""
    shown = " = ".join(short(name) for name in names[:most])
    return shown + (f" (+{len(names) - most} more)" if len(names) > most else "")
