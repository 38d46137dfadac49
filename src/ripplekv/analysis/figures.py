"""The report's plots: score and KL against budget, one line per method with its intervals, and the
per-layer budgets of a prompt of typical length. They read the tables of `analysis.tables` (or the
result lines) and write PNGs through `runs.safeio`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis.plots import pyplot
from ripplekv.runs.files import REFERENCE, is_ceiling
from ripplekv.runs.safeio import save_figure

STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
KL_FLOOR = 1e-8  # kl of a variant that keeps everything can be 0; a log axis needs a floor


_pyplot = pyplot


def plot_score_vs_budget(board: pd.DataFrame, path: Path, ceilings=None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    _method_lines(ax, board, "avg", ceilings=ceilings)
    full = board[board["method"] == REFERENCE]
    if len(full):
        ax.axhline(float(full["avg"].iloc[0]), color="black", linestyle="--", linewidth=1, label="full (reference)")
        if "avg_ci_low" in full:
            ax.axhspan(float(full["avg_ci_low"].iloc[0]), float(full["avg_ci_high"].iloc[0]), color="black", alpha=0.07)
    _budget_axis(ax, board)
    ax.set_ylabel("average score (95% CI)")
    ax.set_title("Score vs KV budget")
    _legend_beside(ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_kl_vs_budget(board: pd.DataFrame, path: Path, ceilings=None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    _method_lines(ax, board, "kl", floor=KL_FLOOR, ceilings=ceilings)
    ax.set_yscale("log")
    _budget_axis(ax, board)
    ax.set_ylabel("KL(full || variant) per answer token (95% CI)")
    ax.set_title("Fidelity to the full cache vs KV budget")
    _legend_beside(ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _method_lines(ax, board: pd.DataFrame, column: str, floor: float | None = None, ceilings=None) -> None:
    """One line per compressed method: `column` against budget, with its `_ci_low/_ci_high` as error bars;
    `ceilings` (labels that know the answer, `runs.files.is_ceiling`) are drawn as bounds."""
    compressed = board[board["method"] != REFERENCE]
    count = compressed["method"].nunique()
    for i, (method, group) in enumerate(compressed.groupby("method", sort=False)):
        dodge = 2 ** (0.04 * (i - (count - 1) / 2))  # side by side on the log2 axis, so the bars stay apart
        group = group.sort_values("budget")
        value = group[column].astype(float).clip(lower=floor)
        yerr = None
        if f"{column}_ci_low" in group:
            low = group[f"{column}_ci_low"].astype(float).clip(lower=floor)
            high = group[f"{column}_ci_high"].astype(float).clip(lower=floor)
            yerr = np.vstack([(value - low).clip(lower=0), (high - value).clip(lower=0)])
        marker, line = STYLES[i % len(STYLES)]
        if is_ceiling(method, ceilings):  # a bound, not a method: grey, dotted, named as such
            ax.errorbar(group["budget"].astype(int) * dodge, value, yerr=yerr, marker="^", linestyle=":", capsize=3,
                        color="grey", label=f"{method} (ceiling)")
            continue
        ax.errorbar(group["budget"].astype(int) * dodge, value, yerr=yerr, marker=marker, linestyle=line, capsize=3, label=method)


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
    """Per-layer budgets of each method at each budget, for a prompt of typical length."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    task, sid = typical_sample(frame)
    rows = frame[(frame["task"] == task) & (frame["id"] == sid) & (frame["method"] != REFERENCE)]
    budgets = sorted(int(b) for b in rows["budget"].dropna().unique()) or [0]
    fig, axes = plt.subplots(1, len(budgets), figsize=(3.6 * len(budgets), 4.2), squeeze=False)
    n = int(rows["prompt_tokens"].iloc[0]) if len(rows) else 0
    for ax, budget in zip(axes[0], budgets):
        for i, (values, names) in enumerate(shared_lines(rows[rows["budget"] == budget]).items()):
            marker, line = STYLES[i % len(STYLES)]
            ax.plot(range(len(values)), values, marker=marker, markersize=3, linestyle=line, label=" = ".join(names))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"B={budget}, n={n}")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    axes[0][0].set_ylabel("entries kept per KV head")
    fig.suptitle(f"Per-layer budgets, prompt of median length ({task}, {sid})", fontsize="medium")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
