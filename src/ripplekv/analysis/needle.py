"""The needle heatmap: accuracy and KL over needle depth x context length, one panel per method at a budget.

It reads eval runs of a needle task (RULER's niah tasks, whose prediction lines carry the needle's `depth`),
one run per context length (`ripplekv needle` makes them): a column per run's target length, a row per depth
rounded to the nearest `depth_step` percent. A cell is the mean over its samples: accuracy is the task's
score x100 (RULER's string_match_all), KL the teacher-forced KL to the full cache's answer. A cell with no
sample is left blank. The full cache's panel comes first (its KL is 0 by definition); the others follow in
the runs' method order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.errors import UserError
from ripplekv.runs.files import CONFIG, REFERENCE

DEPTH_STEP = 10
GRID_COLUMNS = ["method", "budget", "length", "depth", "n", "accuracy", "kl"]


def run_length(run_dir: Path) -> int:
    """The target length an eval run was built at (its config.json)."""
    try:
        config = json.loads((Path(run_dir) / CONFIG).read_text(encoding="utf-8"))
        return int(config["target_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{run_dir} has no readable {CONFIG} with target_tokens; pass folders written by "
                        "`ripplekv eval`") from None


def needle_grid(runs: list[tuple[int, pd.DataFrame]], depth_step: int = DEPTH_STEP) -> pd.DataFrame:
    """`runs`: (context length, prediction lines) per run -> one row per (method, budget, length, depth) with
    its samples `n`, `accuracy` (mean score x100) and mean `kl`. Lines without a depth are left out."""
    if depth_step <= 0:
        raise UserError(f"the depth step must be positive, got {depth_step}")
    parts = []
    for length, frame in runs:
        if "depth" not in frame.columns:
            continue
        lines = frame[frame["depth"].notna()].copy()
        lines["length"] = length
        parts.append(lines)
    if not parts:
        raise UserError("no prediction line has a needle depth: evaluate a needle task (niah_depths or any RULER "
                        "niah task)")
    lines = pd.concat(parts, ignore_index=True)
    lines["depth"] = (np.round(lines["depth"].astype(float) / depth_step) * depth_step).astype(int)
    lines["budget"] = lines["budget"].astype("Int64")
    order = list(dict.fromkeys([REFERENCE, *lines["method"]]))
    grid = (lines.groupby(["method", "budget", "length", "depth"], dropna=False, sort=False)
            .agg(n=("score", "size"), accuracy=("score", "mean"), kl=("kl", "mean")).reset_index())
    grid["accuracy"] = grid["accuracy"] * 100
    grid["rank"] = grid["method"].map({m: i for i, m in enumerate(order)})
    grid = grid.sort_values(["rank", "budget", "length", "depth"], na_position="first").drop(columns="rank")
    return grid[GRID_COLUMNS].reset_index(drop=True)


def panels(grid: pd.DataFrame, budget: int) -> list[tuple[str, pd.DataFrame]]:
    """(method, its rows) for the heatmap at `budget`: the full cache first, then every method run at it."""
    reference = grid[grid["method"] == REFERENCE]
    out = [(REFERENCE, reference)] if len(reference) else []
    at_budget = grid[(grid["method"] != REFERENCE) & (grid["budget"] == budget)]
    out += [(method, rows) for method, rows in at_budget.groupby("method", sort=False)]
    return out


def cell_matrix(rows: pd.DataFrame, value: str, depths: list[int], lengths: list[int]) -> np.ndarray:
    """depth x length matrix of `value`; NaN where no sample fell."""
    table = rows.pivot_table(index="depth", columns="length", values=value, aggfunc="mean")
    return table.reindex(index=depths, columns=lengths).to_numpy(dtype=float)


def plot_needle(grid: pd.DataFrame, budget: int, path: Path, title: str = "") -> None:
    """Two rows of heatmaps (accuracy, KL), a panel per method (full cache first), a colour bar per row."""
    from ripplekv.analysis.plots import pyplot
    from ripplekv.runs.safeio import save_figure

    plt = pyplot()
    shown = panels(grid, budget)
    if len(shown) < 2:
        raise UserError(f"no method besides the full cache was run at budget {budget}")
    depths = sorted(grid["depth"].unique())
    lengths = sorted(grid["length"].unique())
    kl_top = max(float(grid["kl"].max()), 1e-6)
    fig, axes = plt.subplots(2, len(shown), figsize=(1.2 + 2.0 * len(shown), 1.6 + 0.32 * len(depths) * 2),
                             squeeze=False, constrained_layout=True)
    for row, (value, cmap, top, label) in enumerate((("accuracy", "RdYlGn", 100.0, "accuracy (%)"),
                                                      ("kl", "magma_r", kl_top, "KL to the full cache"))):
        colormap = plt.get_cmap(cmap).with_extremes(bad="white")  # blank: no sample in the cell
        for col, (method, rows) in enumerate(shown):
            ax = axes[row][col]
            matrix = np.ma.masked_invalid(cell_matrix(rows, value, depths, lengths))
            image = ax.imshow(matrix, cmap=colormap, vmin=0, vmax=top, aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize="small")
            ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths], fontsize="small")
            if row == 0:
                ax.set_title(method if method == REFERENCE else f"{method}\n@{budget}", fontsize="small")
            if row == 1:
                ax.set_xlabel("target tokens", fontsize="small")
            if col == 0:
                ax.set_ylabel("needle depth", fontsize="small")
        fig.colorbar(image, ax=list(axes[row]), label=label, shrink=0.9)
    fig.suptitle(title or f"Needle retrieval by depth and length, budget {budget}", fontsize="medium")
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def load_runs(run_dirs) -> list[tuple[int, pd.DataFrame]]:
    """(target length, prediction lines) of each eval run folder."""
    from ripplekv.analysis.report import load_predictions

    return [(run_length(Path(d)), load_predictions(d)) for d in run_dirs]


def render(run_dirs, out_dir: Path, budgets, depth_step: int = DEPTH_STEP) -> list[Path]:
    """needle.csv (the grid), needle_b<B>.png per budget and index.html into `out_dir`; returns the paths written."""
    from ripplekv.runs.safeio import write_csv

    grid = needle_grid(load_runs(run_dirs), depth_step)
    out_dir = Path(out_dir)
    written = [out_dir / "needle.csv"]
    write_csv(written[0], grid, float_format="%.6g")
    for budget in budgets:
        written.append(out_dir / f"needle_b{budget}.png")
        plot_needle(grid, budget, written[-1])
    from ripplekv.analysis.html_page import write_needle_page

    written.append(write_needle_page(out_dir))  # the heatmap as a web page, linking each length's run page
    return written
