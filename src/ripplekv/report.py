"""`ripplekv report`: leaderboards, plots and a markdown summary from `predictions.jsonl` alone.

Every line of the predictions file carries what a table needs (task, category, method, budget, score,
fidelity, per-layer budgets), so a report can be re-rendered, or a run's numbers audited, without the
model. Scores follow LongBench: per task `round(100 * mean, 2)`, averages are over tasks.

Ranks: at each budget the compressed methods are ranked by average score (1 = best, ties share the
better rank). `full` is the uncompressed reference every method is measured against; it has no
budget and is not ranked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ripplekv.errors import UserError
from ripplekv.evaluate import PREDICTIONS, REFERENCE, read_lines
from ripplekv.metrics import aggregate
from ripplekv.safeio import save_figure, write_csv, write_text

FLOAT_FORMAT = "%.6g"
STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
KL_FLOOR = 1e-8  # kl of a variant that keeps everything can be 0; a log axis needs a floor


def load_predictions(run_dir: str | Path) -> pd.DataFrame:
    """All result lines of a run (a trailing partial line from a kill is ignored)."""
    path = Path(run_dir) / PREDICTIONS
    if not Path(run_dir).is_dir():
        what = "is a file" if Path(run_dir).exists() else "does not exist"
        raise UserError(f"{run_dir} {what}; pass a directory written by `ripplekv eval`")
    if not path.is_file() and (Path(run_dir) / "profile.json").is_file():
        raise UserError(f"{run_dir} holds a ripplekv profile, not an eval run; pass a directory written by `ripplekv eval`")
    rows, _ = read_lines(path)
    if not rows:
        where = "no" if not path.is_file() else "an empty"
        raise UserError(f"{run_dir} has {where} {PREDICTIONS}; run `ripplekv eval --out {run_dir}` first")
    frame = pd.DataFrame(rows)
    missing = {"id", "task", "category", "method", "budget", "score", "kl", "agreement"} - set(frame.columns)
    if missing:
        raise UserError(f"{path} lacks field(s) {', '.join(sorted(missing))}; was it written by `ripplekv eval`?")
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def _orders(frame: pd.DataFrame) -> tuple[list[str], list[str], list[str]]:
    """Tasks, categories and methods in order of first appearance (full first)."""
    methods = list(dict.fromkeys(frame["method"]))
    if REFERENCE in methods:
        methods.remove(REFERENCE)
        methods.insert(0, REFERENCE)
    return list(dict.fromkeys(frame["task"])), list(dict.fromkeys(frame["category"])), methods


def _sort(table: pd.DataFrame, methods: list[str], tasks: list[str] | None = None) -> pd.DataFrame:
    keys = pd.DataFrame({
        "t": table["task"].map({t: i for i, t in enumerate(tasks)}) if tasks else 0,
        "b": table["budget"].fillna(-1).astype(int),
        "m": table["method"].map({m: i for i, m in enumerate(methods)}),
    }, index=table.index)
    order = keys.sort_values(["t", "b", "m"], kind="stable").index if tasks else \
        keys.sort_values(["b", "m"], kind="stable").index
    return table.loc[order].reset_index(drop=True)


def task_scores(frame: pd.DataFrame) -> pd.DataFrame:
    """scores.csv: one row per task, method and budget (score = round(100*mean, 2); kl, agreement means)."""
    tasks, _, methods = _orders(frame)
    grouped = frame.groupby(["task", "category", "method", "budget"], dropna=False, sort=False)
    table = grouped.agg(
        n=("score", "size"),
        score=("score", lambda s: aggregate(list(s))),
        kl=("kl", "mean"),
        agreement=("agreement", "mean"),
    ).reset_index()
    return _sort(table, methods, tasks)


def leaderboard(scores: pd.DataFrame) -> pd.DataFrame:
    """leaderboard.csv: per method and budget, average over tasks, per-category averages, fidelity, rank."""
    tasks, categories, methods = _orders(scores)
    rows = []
    for (method, budget), group in scores.groupby(["method", "budget"], dropna=False, sort=False):
        row = {"method": method, "budget": budget, "rank": pd.NA, "avg": round(group["score"].mean(), 2)}
        for category in categories:
            values = group.loc[group["category"] == category, "score"]
            row[category] = round(values.mean(), 2) if len(values) else math.nan
        row.update(kl=group["kl"].mean(), agreement=group["agreement"].mean(), tasks=len(group))
        rows.append(row)
    table = pd.DataFrame(rows)
    table["budget"] = table["budget"].astype("Int64")
    ranked = table["method"] != REFERENCE
    table.loc[ranked, "rank"] = table[ranked].groupby("budget")["avg"].rank(method="min", ascending=False)
    table["rank"] = table["rank"].astype("Int64")
    table = _sort(table, methods)
    # Within a budget: best rank first (ties keep method order); full (no budget) stays on top.
    table["_r"] = table["rank"].fillna(0)
    return table.sort_values(["budget", "_r"], kind="stable", na_position="first").drop(columns="_r").reset_index(drop=True)


def leaderboard_wide(scores: pd.DataFrame, board: pd.DataFrame) -> pd.DataFrame:
    """leaderboard_wide.csv: LongBench-style, one column per task (grouped by category), then the average."""
    tasks, categories, _ = _orders(scores)
    category_of = dict(zip(scores["task"], scores["category"]))
    columns = sorted(tasks, key=lambda t: (categories.index(category_of[t]), tasks.index(t)))
    wide = scores.pivot_table(index=["method", "budget"], columns="task", values="score", dropna=False, sort=False)
    keys = pd.MultiIndex.from_frame(board[["method", "budget"]])
    wide = wide.reindex(keys)[columns].reset_index()
    wide.columns.name = None
    wide["avg"] = board["avg"].to_numpy()
    return wide


# --------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_score_vs_budget(board: pd.DataFrame, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _method_lines(ax, board, board["avg"])
    full = board.loc[board["method"] == REFERENCE, "avg"]
    if len(full):
        ax.axhline(float(full.iloc[0]), color="black", linestyle="--", linewidth=1, label="full (reference)")
    _budget_axis(ax, board)
    ax.set_ylabel("average score")
    ax.set_title("Score vs KV budget")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_kl_vs_budget(board: pd.DataFrame, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _method_lines(ax, board, board["kl"].clip(lower=KL_FLOOR))
    ax.set_yscale("log")
    _budget_axis(ax, board)
    ax.set_ylabel("KL(full || variant) per answer token")
    ax.set_title("Fidelity to the full cache vs KV budget")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _method_lines(ax, board: pd.DataFrame, values: pd.Series) -> None:
    """One line per compressed method: `values` (aligned with `board`) against budget."""
    compressed = board[board["method"] != REFERENCE].assign(value=values)
    for i, (method, group) in enumerate(compressed.groupby("method", sort=False)):
        group = group.sort_values("budget")
        marker, line = STYLES[i % len(STYLES)]
        ax.plot(group["budget"].astype(int), group["value"], marker=marker, linestyle=line, label=method)


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


def plot_layer_budgets(frame: pd.DataFrame, path: Path) -> None:
    """Per-layer budgets of each method at each budget, for a prompt of typical length."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    task, sid = typical_sample(frame)
    rows = frame[(frame["task"] == task) & (frame["id"] == sid) & (frame["method"] != REFERENCE)]
    budgets = sorted(int(b) for b in rows["budget"].dropna().unique()) or [0]
    fig, axes = plt.subplots(1, len(budgets), figsize=(3.6 * len(budgets), 3.4), squeeze=False)
    n = int(rows["prompt_tokens"].iloc[0]) if len(rows) else 0
    for ax, budget in zip(axes[0], budgets):
        for i, (_, row) in enumerate(rows[rows["budget"] == budget].iterrows()):
            marker, line = STYLES[i % len(STYLES)]
            ax.plot(range(len(row["layer_budgets"])), row["layer_budgets"], marker=marker, markersize=3,
                    linestyle=line, label=row["method"])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"B={budget}, n={n}")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("entries kept per KV head")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle(f"Per-layer budgets, prompt of median length ({task}, {sid})", fontsize="medium")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- text


def _cell(value) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 0.01 and value != 0 else f"{value:.2f}"
    return str(value)


def markdown_table(table: pd.DataFrame) -> str:
    header = "| " + " | ".join(map(str, table.columns)) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    body = ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body])


def summary_markdown(frame: pd.DataFrame, board: pd.DataFrame, wide: pd.DataFrame, run_dir: Path) -> str:
    samples = frame.drop_duplicates(["task", "id"])
    lines = ["# ripplekv eval summary", ""]
    config_path = run_dir / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            lines.append(f"Model `{config.get('model_label')}`, suite `{config.get('suite')}`, "
                         f"ripplekv {config.get('ripplekv_version')}.")
        except (OSError, json.JSONDecodeError):
            pass
    lines += [
        f"{len(samples)} samples over {samples['task'].nunique()} tasks; prompts of "
        f"{int(samples['prompt_tokens'].min())}-{int(samples['prompt_tokens'].max())} tokens.",
        "",
        "## Leaderboard",
        "",
        "Scores are LongBench-style (per task 100 x mean, averages over tasks). `kl` is KL(full || variant) "
        "per answer token along the full cache's answer, `agreement` the share of those tokens the variant "
        "also predicts. Ranks are per budget among compressed methods; `full` is the reference and unranked.",
        "",
        markdown_table(board),
        "",
        "## Per task",
        "",
        markdown_table(wide),
        "",
        "![score vs budget](score_vs_budget.png) ![kl vs budget](kl_vs_budget.png)",
        "",
        "![per-layer budgets](layer_budgets.png)",
        "",
    ]
    return "\n".join(lines)


def summary_table(board: pd.DataFrame, title: str = "average score (kl) by method and budget"):
    """A rich table: methods x budgets, each cell `score (kl)`."""
    from rich.table import Table

    budgets = sorted(int(b) for b in board["budget"].dropna().unique())
    table = Table(title=title)
    table.add_column("method")
    for budget in budgets:
        table.add_column(f"B={budget}", justify="right")
    for method in dict.fromkeys(board["method"]):
        rows = board[board["method"] == method]
        if method == REFERENCE:
            cell = f"{rows['avg'].iloc[0]:.2f} (ref)"
            table.add_row(method, *([cell] * len(budgets)))
            continue
        cells = []
        for budget in budgets:
            match = rows[rows["budget"] == budget]
            cells.append("–" if match.empty else f"{match['avg'].iloc[0]:.2f} ({match['kl'].iloc[0]:.3g})")
        table.add_row(method, *cells)
    return table


def render(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """Write scores.csv, leaderboard.csv, leaderboard_wide.csv, the plots and summary.md into `run_dir`."""
    run_dir = Path(run_dir)
    frame = load_predictions(run_dir)
    scores = task_scores(frame)
    board = leaderboard(scores)
    wide = leaderboard_wide(scores, board)
    try:
        write_csv(run_dir / "scores.csv", scores, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard.csv", board, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard_wide.csv", wide, float_format=FLOAT_FORMAT)
        plot_score_vs_budget(board, run_dir / "score_vs_budget.png")
        plot_kl_vs_budget(board, run_dir / "kl_vs_budget.png")
        plot_layer_budgets(frame, run_dir / "layer_budgets.png")
        write_text(run_dir / "summary.md", summary_markdown(frame, board, wide, run_dir))
    except OSError as err:
        raise UserError(f"cannot write the report into {run_dir}: {err.strerror or err}") from None
    return {"scores": scores, "leaderboard": board, "leaderboard_wide": wide}
