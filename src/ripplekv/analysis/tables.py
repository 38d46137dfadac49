"""The report's tables, computed from a run's result lines: per-task scores, the leaderboard with its
uncertainty, scores by context length and the wide (one column per task) table.

Scores follow LongBench: per task `round(100 * mean, 2)`, averages are over tasks. Ranks: at each budget
the compressed methods are ranked by average score (1 = best, ties share the better rank); `full` is the
uncompressed reference, has no budget and is not ranked. Uncertainty (`stats`): every average and KL
gets a 95% paired bootstrap interval; every compressed method gets its difference to the uniform
baseline at its budget (`uniform`, else `snapkv`) with an interval and a p-value, and rank probabilities
per budget. A method is called better or worse only when the interval of its difference excludes 0.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ripplekv.analysis import stats
from ripplekv.defaults import UNIFORM_BASELINES
from ripplekv.metrics.scoring import LENGTH_BUCKETS, aggregate, is_longbench_e, length_bucket
from ripplekv.runs.files import REFERENCE, is_ceiling

BASELINES = UNIFORM_BASELINES  # the uniform-allocation baseline of a budget, first one present
TERCILES = ("short", "medium", "long")


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
    if "decode_budget" in frame:  # runs under a total decode budget (prompt-budget runs keep their columns)
        extra["decode_budget"] = ("decode_budget", lambda d: ",".join(sorted(set(d.dropna()))))
        extra["peak_entries"] = ("peak_entries", "mean")
    table = grouped.agg(
        n=("score", "size"),
        score=("score", lambda s: aggregate(list(s))),
        kl=("kl", "mean"),
        agreement=("agreement", "mean"),
        **extra,
    ).reset_index()
    return _sort(table, methods, tasks)


def leaderboard(scores: pd.DataFrame, ceilings=None) -> pd.DataFrame:
    """leaderboard.csv: per method and budget, average over tasks, per-category averages, fidelity, rank.
    `ceilings`: the labels that know the answer (`runs.files.is_ceiling`), left out of ranks."""
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
        if "decode_budget" in group:  # the most entries a head held while decoding, mean over tasks
            row["decode_budget"] = ",".join(sorted(set(group["decode_budget"].dropna())))
            row["peak_entries"] = round(group["peak_entries"].mean(), 3)
        rows.append(row)
    table = pd.DataFrame(rows)
    table["budget"] = table["budget"].astype("Int64")
    ceiling = table["method"].map(lambda m: is_ceiling(m, ceilings)).astype(bool)
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
                    seed: int = stats.SEED, ceilings=None) -> tuple[pd.DataFrame, pd.DataFrame]:
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
    compressed = board[(board["method"] != REFERENCE) & ~board["method"].map(lambda m: is_ceiling(m, ceilings)).astype(bool)]
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
