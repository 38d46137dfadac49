"""`ripplekv report`: leaderboards, plots and a markdown summary from `predictions.jsonl` alone.

Every line of the predictions file carries what a table needs (task, category, method, budget, score,
fidelity, per-layer budgets), so a report can be re-rendered, or a run's numbers audited, without the
model. Scores follow LongBench: per task `round(100 * mean, 2)`, averages are over tasks.

Ranks: at each budget the compressed methods are ranked by average score (1 = best, ties share the
better rank). `full` is the uncompressed reference every method is measured against; it has no
budget and is not ranked.

Uncertainty (`stats`): every average and KL gets a 95% paired bootstrap interval; every compressed
method gets its difference to the uniform baseline at its budget (`uniform`, else `snapkv`) with an
interval and a p-value, and rank probabilities per budget. A method is called better or worse only
when the interval of its difference excludes 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis import stats
from ripplekv.analysis.plots import pyplot
from ripplekv.defaults import UNIFORM_BASELINES
from ripplekv.errors import UserError
from ripplekv.metrics.rouge import check_rouge
from ripplekv.metrics.scoring import (
    LENGTH_BUCKETS,
    aggregate,
    is_longbench_e,
    length_bucket,
    metric_label,
    score_sample,
)
from ripplekv.runs.files import PREDICTIONS, REFERENCE, REPORT_FILES, is_ceiling  # noqa: F401  (re-exported)
from ripplekv.runs.jsonl import read_jsonl, torn_fields
from ripplekv.runs.safeio import save_figure, write_csv, write_text

FLOAT_FORMAT = "%.6g"
STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
KL_FLOOR = 1e-8  # kl of a variant that keeps everything can be 0; a log axis needs a floor
BASELINES = UNIFORM_BASELINES  # the uniform-allocation baseline of a budget, first one present
TERCILES = ("short", "medium", "long")


def check_run_folder(run_dir: str | Path) -> Path:
    """`run_dir` as a Path, or one line saying it is not a directory."""
    if not Path(run_dir).is_dir():
        what = "is a file" if Path(run_dir).exists() else "does not exist"
        raise UserError(f"{run_dir} {what}; pass a directory written by `ripplekv eval`")
    return Path(run_dir)


def load_predictions(run_dir: str | Path) -> pd.DataFrame:
    """All result lines of a run. After a kill mid-write (a torn last line), the sample being written is
    left out, with a note naming it: every variant is then ranked on the same samples."""
    path = check_run_folder(run_dir) / PREDICTIONS
    if not path.is_file() and (Path(run_dir) / "profile.json").is_file():
        raise UserError(f"{run_dir} holds a ripplekv profile, not an eval run; pass a directory written by `ripplekv eval`")
    lines = read_jsonl(path)
    rows = lines.objects
    if lines.torn and lines.torn.strip():
        rows = without_torn_sample(path, rows, lines.torn)
    if not rows:
        where = "no" if not path.is_file() else "an empty"
        raise UserError(f"{run_dir} has {where} {PREDICTIONS}; run `ripplekv eval --out {run_dir}` first")
    frame = pd.DataFrame(rows)
    missing = {"id", "task", "category", "method", "budget", "score", "kl", "agreement"} - set(frame.columns)
    if missing:
        raise UserError(f"{path} lacks field(s) {', '.join(sorted(missing))}; was it written by `ripplekv eval`?")
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def without_torn_sample(path: Path, rows: list[dict], torn: bytes) -> list[dict]:
    """`rows` less the sample the torn line belongs to (its readable `task`/`id`, else the last whole
    line's sample, as `eval` cuts it when it resumes); says which on stderr."""
    import sys

    found = torn_fields(torn)
    last = rows[-1] if rows else {}
    task, sid = found.get("task", last.get("task") if "id" not in found else None), found.get("id", last.get("id"))
    variant = f"{found['method']}@{found.get('budget')}" if "method" in found else "not readable"
    kept = [r for r in rows if not (r.get("id") == sid and (task is None or r.get("task") == task))]
    sample = f"{task}/{sid}" if task is not None else str(sid)
    print(f"note: {path} ends in a torn line (a kill mid-write; variant {variant}, sample {sample}): "
          f"{len(rows) - len(kept)} lines of that sample are left out of this report; rerun `ripplekv eval` "
          "with the same options to finish it", file=sys.stderr)
    return kept


def rescore_rouge(frame: pd.DataFrame, rouge: str) -> pd.DataFrame:
    """Rescore the ROUGE tasks of a run with another ROUGE implementation (from each line's prediction
    and answers); other tasks keep the score eval gave them."""
    if check_rouge(rouge) == "official":
        return frame
    tasks = [t for t in frame["task"].unique() if metric_label(t, rouge) != metric_label(t)]
    rows = frame["task"].isin(tasks)
    if rows.any() and not {"prediction", "answers"} <= set(frame.columns):
        raise UserError("--rouge rouge-score needs each line's 'prediction' and 'answers'; rerun `ripplekv eval`")
    frame = frame.copy()
    frame.loc[rows, "score"] = [score_sample(t, p, a, rouge=rouge) for t, p, a in
                                zip(frame.loc[rows, "task"], frame.loc[rows, "prediction"], frame.loc[rows, "answers"])]
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
    extra = {"protocol": ("protocol", lambda p: ",".join(sorted(set(p.dropna()))))} if "protocol" in frame else {}
    table = grouped.agg(
        n=("score", "size"),
        score=("score", lambda s: aggregate(list(s))),
        kl=("kl", "mean"),
        agreement=("agreement", "mean"),
        **extra,
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
        if "protocol" in group:
            row["protocol"] = ",".join(sorted(set(group["protocol"].dropna())))
        rows.append(row)
    table = pd.DataFrame(rows)
    table["budget"] = table["budget"].astype("Int64")
    ceiling = table["method"].map(is_ceiling).astype(bool)
    ranked = (table["method"] != REFERENCE) & ~ceiling
    table.loc[ranked, "rank"] = table[ranked].groupby("budget")["avg"].rank(method="min", ascending=False)
    table["rank"] = table["rank"].astype("Int64")
    if ceiling.any():  # headroom: how far the ceiling is above the best real method at its budget
        best = table[ranked].groupby("budget")["avg"].max()
        table["headroom"] = [round(avg - best[budget], 2) if is_top and budget in best.index else math.nan
                             for avg, budget, is_top in zip(table["avg"], table["budget"], ceiling)]
    table = _sort(table, methods)
    # Within a budget: best rank first (ties keep method order); full (no budget) stays on top.
    table["_r"] = table["rank"].fillna(0)
    return table.sort_values(["budget", "_r"], kind="stable", na_position="first").drop(columns="_r").reset_index(drop=True)


def _floor2(x):
    """Round down to 2 decimals (the 6-digit round first keeps 33.33 from becoming 33.32); no -0."""
    return np.floor(np.round(np.asarray(x, dtype=float) * 100, 6)) / 100 + 0.0


def _ceil2(x):
    return np.ceil(np.round(np.asarray(x, dtype=float) * 100, 6)) / 100 + 0.0


def _board_rows(board: pd.DataFrame, table: pd.DataFrame) -> list[int]:
    """For each row of `table`, the row of the leaderboard with its method and budget."""
    def key(method, budget):
        return method, -1 if pd.isna(budget) else int(budget)

    rows = {key(m, b): i for i, (m, b) in enumerate(zip(board["method"], board["budget"]))}
    return [rows[key(m, b)] for m, b in zip(table["method"], table["budget"])]


def baseline_of(methods) -> str | None:
    """The uniform baseline among the methods of one budget: `uniform`, else `snapkv`, else none."""
    return next((name for name in BASELINES if name in set(methods)), None)


def add_uncertainty(frame: pd.DataFrame, board: pd.DataFrame, resamples: int = stats.RESAMPLES,
                    seed: int = stats.SEED) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Leaderboard with 95% intervals, differences to the uniform baseline and p-values; and ranks.csv.

    Score intervals are widened to 2 decimals (down / up) and always contain the rounded value shown,
    so `avg_ci_low <= avg <= avg_ci_high` holds on every row.
    """
    frame = frame.assign(key=_board_rows(board, frame))
    boot = stats.Bootstrap.draw(frame, resamples, seed)
    order = list(range(len(board)))
    _, scores = boot.replicates(frame, "score", order)
    scores = 100 * scores
    _, kls = boot.replicates(frame, "kl", order)

    board = board.copy()
    avg, kl = board["avg"].to_numpy(float), board["kl"].to_numpy(float)
    low, high = stats.interval(scores)
    board.insert(board.columns.get_loc("avg") + 1, "avg_ci_low", _floor2(np.minimum(low, avg)))
    board.insert(board.columns.get_loc("avg") + 2, "avg_ci_high", _ceil2(np.maximum(high, avg)))
    low, high = stats.interval(kls)
    board.insert(board.columns.get_loc("kl") + 1, "kl_ci_low", np.minimum(low, kl))
    board.insert(board.columns.get_loc("kl") + 2, "kl_ci_high", np.maximum(high, kl))

    delta = np.full((4, len(board)), np.nan)  # delta, low, high, p
    kl_delta = np.full((4, len(board)), np.nan)  # the same for KL to the full cache (lower is better)
    ranks = []
    compressed = board[(board["method"] != REFERENCE) & ~board["method"].map(is_ceiling).astype(bool)]
    for budget, group in compressed.groupby("budget", sort=True):
        rows = group.index.to_numpy()
        base = baseline_of(group["method"])
        if base is not None:
            b = group.index[group["method"] == base][0]
            diff = scores[rows] - scores[b]
            point = np.round(avg[rows] - avg[b], 2)
            low, high = stats.interval(diff)
            delta[:, rows] = [point, _floor2(np.minimum(low, point)), _ceil2(np.maximum(high, point)), stats.p_value(diff)]
            kl_diff = kls[rows] - kls[b]
            kl_point = kl[rows] - kl[b]
            low, high = stats.interval(kl_diff)
            kl_delta[:, rows] = [kl_point, np.minimum(low, kl_point), np.maximum(high, kl_point), stats.p_value(kl_diff)]
        first, expected = stats.rank_probabilities(scores[rows])
        ranks += [{"method": m, "budget": int(budget), "p_rank1": p, "expected_rank": e}
                  for m, p, e in zip(group["method"], first, expected)]
    for name, values in zip(("delta_vs_uniform", "delta_ci_low", "delta_ci_high", "p_vs_uniform"), delta):
        board[name] = values
    for name, values in zip(("kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high", "p_kl_vs_uniform"), kl_delta):
        board[name] = values
    ranks = pd.DataFrame(ranks, columns=["method", "budget", "p_rank1", "expected_rank"])
    return board, ranks


def kl_verdict(row) -> str:
    """For KL lower is better: `closer` / `further` from the full cache only when the interval excludes 0."""
    if pd.isna(row["kl_delta_ci_low"]):
        return ""
    if row["kl_delta_ci_high"] < 0:
        return "closer"
    if row["kl_delta_ci_low"] > 0:
        return "further"
    return "n.s."


def verdict(row) -> str:
    """`better` / `worse` only when the interval of the difference excludes 0."""
    if pd.isna(row["delta_ci_low"]):
        return ""
    if row["delta_ci_low"] > 0:
        return "better"
    if row["delta_ci_high"] < 0:
        return "worse"
    return "n.s."


def length_buckets(frame: pd.DataFrame) -> tuple[pd.Series, tuple[str, ...]] | None:
    """Bucket of each line by the sample's `length` (words of context), or None without lengths.

    A LongBench-E run uses the official buckets 0-4k / 4-8k / 8k+. Other suites (the offline one
    builds every prompt near one target length) use each task's own terciles, short / medium /
    long, so every bucket holds every task and a bucket's average is not a proxy for its tasks.
    """
    if "length" not in frame.columns:
        return None
    length = pd.to_numeric(frame["length"], errors="coerce")
    if length.isna().all():
        return None
    if all(is_longbench_e(task) for task in frame["task"].unique()):
        return length.map(lambda n: length_bucket(n) if pd.notna(n) else None), LENGTH_BUCKETS
    samples = frame.assign(length=length).dropna(subset=["length"]).drop_duplicates(["task", "id"])
    samples = samples.sort_values(["task", "length", "id"], kind="stable")
    position = samples.groupby("task").cumcount() / samples.groupby("task")["id"].transform("size")
    bucket = dict(zip(zip(samples["task"], samples["id"]), [TERCILES[int(3 * q)] for q in position]))
    return pd.Series([bucket.get(key) for key in zip(frame["task"], frame["id"])], index=frame.index), TERCILES


def length_table(frame: pd.DataFrame, board: pd.DataFrame) -> pd.DataFrame | None:
    """lengths.csv: per method, budget and length bucket, the LongBench average over the tasks present
    in the bucket, with the bucket's number of samples and range of lengths; None without lengths."""
    found = length_buckets(frame)
    if found is None:
        return None
    buckets, names = found
    frame = frame.assign(bucket=buckets, length=pd.to_numeric(frame["length"], errors="coerce")).dropna(subset=["bucket"])
    per_task = frame.groupby(["method", "budget", "bucket", "task"], dropna=False, sort=False).agg(
        score=("score", lambda v: aggregate(list(v))), kl=("kl", "mean"), n=("id", "nunique"),
        lo=("length", "min"), hi=("length", "max"),
    ).reset_index()
    table = per_task.groupby(["method", "budget", "bucket"], dropna=False, sort=False).agg(
        length_min=("lo", "min"), length_max=("hi", "max"), samples=("n", "sum"), tasks=("task", "size"),
        avg=("score", "mean"), kl=("kl", "mean"),
    ).reset_index()
    table["avg"] = table["avg"].round(2)
    table["length_min"] = table["length_min"].astype(int)
    table["length_max"] = table["length_max"].astype(int)
    table["_k"] = _board_rows(board, table)
    table["_b"] = table["bucket"].map(names.index)
    return table.sort_values(["_k", "_b"]).drop(columns=["_k", "_b"]).reset_index(drop=True)


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


_pyplot = pyplot


def plot_score_vs_budget(board: pd.DataFrame, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _method_lines(ax, board, "avg")
    full = board[board["method"] == REFERENCE]
    if len(full):
        ax.axhline(float(full["avg"].iloc[0]), color="black", linestyle="--", linewidth=1, label="full (reference)")
        if "avg_ci_low" in full:
            ax.axhspan(float(full["avg_ci_low"].iloc[0]), float(full["avg_ci_high"].iloc[0]), color="black", alpha=0.07)
    _budget_axis(ax, board)
    ax.set_ylabel("average score (95% CI)")
    ax.set_title("Score vs KV budget")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_kl_vs_budget(board: pd.DataFrame, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _method_lines(ax, board, "kl", floor=KL_FLOOR)
    ax.set_yscale("log")
    _budget_axis(ax, board)
    ax.set_ylabel("KL(full || variant) per answer token (95% CI)")
    ax.set_title("Fidelity to the full cache vs KV budget")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _method_lines(ax, board: pd.DataFrame, column: str, floor: float | None = None) -> None:
    """One line per compressed method: `column` against budget, with its `_ci_low/_ci_high` as error bars."""
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
        if is_ceiling(method):  # a bound, not a method: grey, dotted, named as such
            ax.errorbar(group["budget"].astype(int) * dodge, value, yerr=yerr, marker="^", linestyle=":", capsize=3,
                        color="grey", label=f"{method} (ceiling)")
            continue
        ax.errorbar(group["budget"].astype(int) * dodge, value, yerr=yerr, marker=marker, linestyle=line, capsize=3, label=method)


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


def _interval(low, high, digits: str = ".2f") -> str:
    if pd.isna(low):
        return "–"
    return f"[{low:{digits}}, {high:{digits}}]"


def leaderboard_view(board: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard for reading: intervals as `[low, high]` next to their value, no test columns."""
    view = board.drop(columns=["delta_vs_uniform", "delta_ci_low", "delta_ci_high", "p_vs_uniform", "kl_delta_vs_uniform",
                               "kl_delta_ci_low", "kl_delta_ci_high", "p_kl_vs_uniform"])
    view.insert(view.columns.get_loc("avg_ci_low"), "95% CI", [_interval(a, b) for a, b in zip(board["avg_ci_low"], board["avg_ci_high"])])
    view.insert(view.columns.get_loc("kl_ci_low"), "kl 95% CI", [_interval(a, b, ".3g") for a, b in zip(board["kl_ci_low"], board["kl_ci_high"])])
    return view.drop(columns=["avg_ci_low", "avg_ci_high", "kl_ci_low", "kl_ci_high"])


def differences_view(board: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """Per budget and compressed method: difference to the uniform baseline, its interval, p, verdict, ranks."""
    rows = board[board["method"] != REFERENCE].merge(ranks, on=["method", "budget"], how="left")
    baseline = {b: baseline_of(g["method"]) for b, g in rows.groupby("budget")}
    return pd.DataFrame({
        "budget": rows["budget"],
        "method": rows["method"],
        "avg": rows["avg"],
        "vs": [baseline[b] or "–" for b in rows["budget"]],
        "difference": rows["delta_vs_uniform"],
        "95% CI": [_interval(a, b) for a, b in zip(rows["delta_ci_low"], rows["delta_ci_high"])],
        "p": rows["p_vs_uniform"],
        "verdict": ["baseline" if m == baseline[b] else verdict(r) or "–" for m, b, (_, r) in
                    zip(rows["method"], rows["budget"], rows.iterrows())],
        "P(rank 1)": rows["p_rank1"],
        "expected rank": rows["expected_rank"],
        "KL difference": rows["kl_delta_vs_uniform"],
        "KL 95% CI": [_interval(a, b, ".3f") for a, b in zip(rows["kl_delta_ci_low"], rows["kl_delta_ci_high"])],
        "KL verdict": ["baseline" if m == baseline[b] else kl_verdict(r) or "–" for m, b, (_, r) in
                       zip(rows["method"], rows["budget"], rows.iterrows())],
    })


def summary_markdown(frame: pd.DataFrame, board: pd.DataFrame, wide: pd.DataFrame, run_dir: Path,
                     ranks: pd.DataFrame | None = None, lengths: pd.DataFrame | None = None,
                     settings: dict | None = None) -> str:
    samples = frame.drop_duplicates(["task", "id"])
    settings = settings or {}
    lines = ["# ripplekv eval summary", ""]
    config_path = run_dir / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            lines.append(f"Model `{config.get('model_label')}`, suite `{config.get('suite')}`, "
                         f"ripplekv {config.get('ripplekv_version')}.")
        except (OSError, json.JSONDecodeError):
            pass
    rouge = settings.get("rouge", "official")
    lines += [
        f"{len(samples)} samples over {samples['task'].nunique()} tasks; prompts of "
        f"{int(samples['prompt_tokens'].min())}-{int(samples['prompt_tokens'].max())} tokens.",
        "ROUGE-L: " + ("official (`rouge` package, LongBench parity)." if rouge == "official"
                       else "Google's `rouge-score` (rougeL F1, Porter stemmer) instead of the official scorer."),
        "",
        "## Leaderboard",
        "",
        "Scores are LongBench-style (per task 100 x mean, averages over tasks). `kl` is KL(full || variant) "
        "per answer token along the full cache's answer, `agreement` the share of those tokens the variant "
        "also predicts. Ranks are per budget among compressed methods; `full` is the reference and unranked. "
        f"Intervals are 95% paired bootstrap intervals ({settings.get('resamples', stats.RESAMPLES)} resamples "
        f"of the samples within each task, seed {settings.get('seed', stats.SEED)}).",
        "",
        markdown_table(leaderboard_view(board)),
        "",
    ]
    if ranks is not None:
        lines += [
            "## Differences to the uniform baseline",
            "",
            "Each compressed method against `uniform` (else `snapkv`) at the same budget, on the same resampled "
            "samples (paired). `better` / `worse`: the 95% interval of the difference excludes 0; `n.s.`: it "
            "does not, and the data cannot tell the two apart. `p` is two-sided. `P(rank 1)` and `expected rank`: "
            "how often the method had the best average at its budget over the resamples, and its mean rank.",
            "",
            markdown_table(differences_view(board, ranks)),
            "",
        ]
    if lengths is not None:
        buckets = list(dict.fromkeys(lengths["bucket"]))
        by_length = lengths.pivot_table(index=["method", "budget"], columns="bucket", values="avg", sort=False, dropna=False)
        keys = pd.MultiIndex.from_frame(board[["method", "budget"]])
        by_length = by_length.reindex(keys)[buckets].reset_index()
        by_length.columns.name = None
        reference = lengths[lengths["method"] == lengths["method"].iloc[0]]
        described = ", ".join(f"{r.bucket}: {r.samples} samples of {r.length_min}-{r.length_max} words"
                              for r in reference.itertuples())
        how = ("LongBench-E buckets" if set(buckets) <= set(LENGTH_BUCKETS)
               else "each task's samples split into thirds by length, so every bucket holds every task")
        lines += ["## By context length", "", f"Average score by context length ({how}; {described}).", "",
                  markdown_table(by_length), ""]
    lines += [
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
    """A rich table: methods x budgets, each cell `score (kl)`, marked when significantly better or
    worse than the uniform baseline at that budget."""
    from rich.table import Table

    budgets = sorted(int(b) for b in board["budget"].dropna().unique())
    marked = "delta_ci_low" in board
    caption = ("▲ / ▼: better / worse than uniform (else snapkv) at that budget, 95% paired bootstrap interval "
               "of the difference excluding 0; unmarked: no significant difference") if marked else None
    table = Table(title=title, caption=caption)
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
            if match.empty:
                cells.append("–")
                continue
            row = match.iloc[0]
            mark = {"better": "▲", "worse": "▼"}.get(verdict(row), "") if marked else ""
            cells.append(f"{mark}{row['avg']:.2f} ({row['kl']:.3g})")
        table.add_row(method, *cells)
    return table


# What `render` writes (listed at the end of `ripplekv eval` and `ripplekv report`; lengths.csv only when
# samples carry a length).


def render(run_dir: str | Path, rouge: str = "official", resamples: int = stats.RESAMPLES,
           seed: int = stats.SEED) -> dict[str, pd.DataFrame]:
    """Write scores.csv, leaderboard.csv, leaderboard_wide.csv, ranks.csv, lengths.csv (when samples have
    a length), the plots, summary.md and report.json (the settings) into `run_dir`."""
    run_dir = Path(run_dir)
    check_rouge(rouge)
    if resamples < 1:
        raise UserError(f"--resamples must be a positive number, got {resamples}")
    frame = rescore_rouge(load_predictions(run_dir), rouge)
    scores = task_scores(frame)
    board, ranks = add_uncertainty(frame, leaderboard(scores), resamples, seed)
    wide = leaderboard_wide(scores, board)
    lengths = length_table(frame, board)
    settings = {"rouge": rouge, "resamples": resamples, "seed": seed, "confidence": stats.CONFIDENCE}
    try:
        write_csv(run_dir / "scores.csv", scores, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard.csv", board, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard_wide.csv", wide, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "ranks.csv", ranks, float_format=FLOAT_FORMAT)
        if lengths is not None:
            write_csv(run_dir / "lengths.csv", lengths, float_format=FLOAT_FORMAT)
        write_text(run_dir / "report.json", json.dumps(settings, indent=2) + "\n")
        plot_score_vs_budget(board, run_dir / "score_vs_budget.png")
        plot_kl_vs_budget(board, run_dir / "kl_vs_budget.png")
        plot_layer_budgets(frame, run_dir / "layer_budgets.png")
        write_text(run_dir / "summary.md", summary_markdown(frame, board, wide, run_dir, ranks, lengths, settings))
    except OSError as err:
        raise UserError(f"cannot write the report into {run_dir}: {err.strerror or err}") from None
    return {"scores": scores, "leaderboard": board, "leaderboard_wide": wide, "ranks": ranks, "lengths": lengths}
