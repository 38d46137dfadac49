"""The report's tables, computed from a run's result lines: per-task scores, the leaderboard with its
uncertainty, scores by context length and the wide (one column per task) table.

Fidelity first: the leaderboard leads with KL to the full cache and agreement, and ranks each budget's
compressed methods by mean KL (1 = closest; ties share the better rank); `full` is the uncompressed
reference, has no budget and is not ranked, nor are answer-aware variants. Scores follow LongBench: per
task `round(100 * mean, 2)`, averages are over tasks; `avg` covers every task, `avg_informative` only the
tasks on which the full cache beats a trivial answer (`analysis.informative`), and is the score the
comparisons use. Uncertainty (`analysis.inference`): every mean gets a stratified t interval; every
compressed row its paired difference to the budget's uniform baseline (`uniform`, else `snapkv`, or the
run's declared one) with an interval, a sign-flip p and Holm's adjustment over all the table's
comparisons of that measure, a verdict and the minimum detectable difference; `ranks.csv` gives rank
probabilities from a paired bootstrap (`stats`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ripplekv.analysis import inference, proportions, stats
from ripplekv.defaults import UNIFORM_BASELINES
from ripplekv.metrics.scoring import LENGTH_BUCKETS, aggregate, is_longbench_e, length_bucket
from ripplekv.runs.files import REFERENCE, is_ceiling

BASELINES = UNIFORM_BASELINES  # the uniform-allocation baseline of a budget, first one present
TERCILES = ("short", "medium", "long")
# The paired comparison columns of one measure: (difference, interval low, high, p, Holm p, verdict, detectable).
KL_TEST = ("kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high", "p_kl_vs_uniform", "p_kl_vs_uniform_holm",
           "kl_verdict", "kl_mdd")
KL_RATIO = ("kl_ratio_vs_uniform", "kl_ratio_ci_low", "kl_ratio_ci_high")  # KL / the baseline's, with its interval
SCORE_TEST = ("delta_vs_uniform", "delta_ci_low", "delta_ci_high", "p_vs_uniform", "p_vs_uniform_holm", "verdict",
              "score_mdd")


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


def task_scores(frame: pd.DataFrame, informative: pd.DataFrame | None = None) -> pd.DataFrame:
    """scores.csv: one row per task, method and budget (score = round(100*mean, 2); kl, agreement means), and
    the task's `informative` flag when `informative` (`analysis.informative.informative_tasks`) is given."""
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
    if informative is not None:
        table["informative"] = table["task"].map(dict(zip(informative["task"], informative["informative"]))).astype("boolean")
    return _sort(table, methods, tasks)


def leaderboard(scores: pd.DataFrame, ceilings=None, counted: list[str] | None = None) -> pd.DataFrame:
    """leaderboard.csv: per method and budget, fidelity (KL, agreement), the average score over the informative
    tasks (`counted`, default all) and over all tasks, per-category averages, rank by KL. `ceilings`: the
    answer-aware labels (`runs.files.is_ceiling`), left out of ranks."""
    tasks, categories, methods = _orders(scores)
    counted = tasks if counted is None else counted
    rows = []
    for (method, budget), group in scores.groupby(["method", "budget"], dropna=False, sort=False):
        chosen = group.loc[group["task"].isin(counted), "score"]
        row = {"method": method, "budget": budget, "rank": pd.NA, "n": int(group["n"].sum()), "kl": group["kl"].mean(),
               "agreement": group["agreement"].mean(),
               "avg_informative": round(chosen.mean(), 2) if len(chosen) else math.nan,
               "avg": round(group["score"].mean(), 2)}
        for category in categories:
            values = group.loc[group["category"] == category, "score"]
            row[category] = round(values.mean(), 2) if len(values) else math.nan
        row.update(tasks=len(group), informative_tasks=" ".join(sorted(t for t in tasks if t in set(counted))))
        if "protocol" in group:
            row["protocol"] = ",".join(sorted(set(group["protocol"].dropna())))
        if "decode_budget" in group:  # the most entries a head held while decoding, mean over tasks
            row["decode_budget"] = ",".join(sorted(set(group["decode_budget"].dropna())))
            row["peak_entries"] = round(group["peak_entries"].mean(), 3)
        rows.append(row)
    table = pd.DataFrame(rows)
    table["budget"] = table["budget"].astype("Int64")
    table.insert(table.columns.get_loc("n") + 1, "fewer_samples", fewer_samples(table["n"]))
    ranked = (table["method"] != REFERENCE) & ~_aware(table, ceilings) & ~table["fewer_samples"]
    table.loc[ranked, "rank"] = table[ranked].groupby("budget")["kl"].rank(method="min", ascending=True)
    table["rank"] = table["rank"].astype("Int64")
    table = _sort(table, methods)
    # Within a budget: best rank first (ties keep method order), answer-aware rows last; full (no budget) on top.
    table["_r"] = table["rank"].astype("Float64").fillna(math.inf)
    return table.sort_values(["budget", "_r"], kind="stable", na_position="first").drop(columns="_r").reset_index(drop=True)


def fewer_samples(n: pd.Series) -> pd.Series:
    """Rows with fewer samples than their table's n (the most any row has): shown apart, never ranked, since a
    mean over fewer questions is not the same statistic (a 1-sample row ranked among 6-sample rows)."""
    n = pd.to_numeric(n, errors="coerce")
    return (n < n.max()).fillna(False).astype(bool) if n.notna().any() else pd.Series(False, index=n.index)


def _aware(table: pd.DataFrame, ceilings) -> pd.Series:
    return table["method"].map(lambda m: is_ceiling(m, ceilings)).astype(bool)


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


def baseline_of(methods, declared: str | None = None) -> str | None:
    """The baseline among the methods of one budget: the run's declared one when present, else `uniform`,
    else `snapkv`, else none."""
    present = set(methods)
    return next((name for name in ((declared,) if declared else ()) + BASELINES if name in present), None)


def compare(values: inference.Samples, pairs: list[tuple[int, int]], scale: float = 1.0,
            permutations: int = inference.PERMUTATIONS, seed: int = inference.SEED) -> pd.DataFrame:
    """Paired comparisons of rows `i` minus `j` of `values` for each (i, j), one Holm family: difference
    (stratified mean over the samples both have), interval, sign-flip p, Holm's p over these pairs, minimum
    detectable difference. The interval is Tango's paired one (MOVER over tasks) where every task of the pair
    is an accuracy (`analysis.proportions`), the stratified t interval otherwise, cut to what a difference of
    two values within `values.bounds` can be."""
    columns = ["delta", "low", "high", "p", "p_holm", "mdd"]
    if not pairs:
        return pd.DataFrame(columns=columns)
    first, second = (np.array(side) for side in zip(*pairs))
    differences = scale * (values.values[first] - values.values[second])
    estimate = inference.t_interval(differences, values.tasks)
    low, high = estimate.low, estimate.high
    binary = values.all_accuracy(differences)
    if binary.any():
        top = values.bounds[1]
        _, low[binary], high[binary] = proportions.paired_accuracy_interval(
            values.values[first[binary]], values.values[second[binary]], values.tasks, top)
        low[binary], high[binary] = scale * low[binary], scale * high[binary]
    reach = scale * (values.bounds[1] - values.bounds[0])
    p = inference.sign_flip_p(differences, values.tasks, permutations, seed)
    mdd = estimate.detectable()
    # An accuracy difference's SD is 0 when no pair is discordant, which would make any n look powerful: its
    # detectable difference is taken from the standard error its score interval implies instead.
    mdd[binary] = inference.minimum_detectable((high[binary] - low[binary]) / (2 * inference.Z95), np.inf)
    return pd.DataFrame({"delta": estimate.point, "low": np.clip(low, -reach, reach),
                         "high": np.clip(high, -reach, reach), "p": p, "p_holm": inference.holm(p), "mdd": mdd})


def measure_samples(frame: pd.DataFrame, order: list, counted: list[str]):
    """(kl, agreement, score x100 on every task, score x100 on the `counted` tasks or None) per leaderboard row
    (`frame`'s `key`) and sample, each knowing its scale and which tasks are accuracies."""
    accuracy = proportions.accuracy_tasks(frame)
    kl = inference.sample_matrix(frame, "kl", order, bounds=(0.0, np.inf))
    agreement = inference.sample_matrix(frame, "agreement", order, bounds=(0.0, 1.0))
    scored = frame.assign(score=100 * frame["score"])
    score = inference.sample_matrix(scored, "score", order, accuracy=accuracy, bounds=(0.0, 100.0))
    chosen = scored[scored["task"].isin(counted)]
    informative = (inference.sample_matrix(chosen, "score", order, accuracy=accuracy, bounds=(0.0, 100.0))
                   if len(chosen) else None)
    return kl, agreement, score, informative


def add_uncertainty(frame: pd.DataFrame, board: pd.DataFrame, resamples: int = stats.RESAMPLES,
                    seed: int = stats.SEED, ceilings=None, counted: list[str] | None = None,
                    declared: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Leaderboard with 95% intervals, paired differences to the baseline with p, Holm p, verdict and
    detectable difference (KL first, then the score over the `counted` tasks); and ranks.csv.

    Score intervals are widened to 2 decimals (down / up) and always contain the rounded value shown, so
    `avg_ci_low <= avg <= avg_ci_high` holds on every row."""
    frame = frame.assign(key=_board_rows(board, frame))
    order = list(range(len(board)))
    counted = list(dict.fromkeys(frame["task"])) if counted is None else counted
    kl, agreement, score, informative = measure_samples(frame, order, counted)

    board = board.copy()
    for name, values in (("kl", kl), ("agreement", agreement)):
        low, high = inference.mean_interval(values)
        point = board[name].to_numpy(float)
        board.insert(board.columns.get_loc(name) + 1, f"{name}_ci_low", np.minimum(low, point))
        board.insert(board.columns.get_loc(name) + 2, f"{name}_ci_high", np.maximum(high, point))
    for name, values in (("avg", score), ("avg_informative", informative)):
        point = board[name].to_numpy(float)
        interval = inference.mean_interval(values) if values is not None else None
        low = _floor2(np.minimum(interval[0], point)) if interval else np.full(len(board), np.nan)
        high = _ceil2(np.maximum(interval[1], point)) if interval else np.full(len(board), np.nan)
        board.insert(board.columns.get_loc(name) + 1, f"{name}_ci_low", low)
        board.insert(board.columns.get_loc(name) + 2, f"{name}_ci_high", high)

    aware = _aware(board, ceilings)
    compressed = board[board["method"] != REFERENCE]
    pairs, versus = [], [None] * len(board)
    for _, group in compressed.groupby("budget", sort=True):
        base = baseline_of(group["method"], declared)
        if base is None:
            continue
        b = int(group.index[group["method"] == base][0])
        for row in group.index:
            versus[row] = base
            if row != b:
                pairs.append((int(row), b))
    where = board.columns.get_loc("agreement_ci_high") + 1
    board.insert(where, "versus", versus)
    _insert_tests(board, kl, pairs, KL_TEST, where + 1, lower_is_better=True, resamples_seed=seed,
                  meaningful=inference.MEANINGFUL["kl"])
    ratio = np.full((3, len(board)), np.nan)  # the KL as a multiple of the baseline's, for the forest plots
    if pairs:
        first, second = (np.array(side) for side in zip(*pairs))
        ratio[:, first] = inference.ratio_interval(kl.values[first], kl.values[second], kl.tasks)
        ratio[:, sorted(set(second))] = 1.0
    at = board.columns.get_loc("kl_mdd") + 1
    for offset, name in enumerate(KL_RATIO):
        board.insert(at + offset, name, ratio[offset])
    if informative is not None:
        _insert_tests(board, informative, pairs, SCORE_TEST, board.columns.get_loc("avg_informative_ci_high") + 1,
                      lower_is_better=False, resamples_seed=seed, rounded=board["avg_informative"].to_numpy(float),
                      meaningful=inference.MEANINGFUL["score"])
    else:
        at = board.columns.get_loc("avg_informative_ci_high") + 1
        for offset, name in enumerate(SCORE_TEST):
            board.insert(at + offset, name, "" if name == "verdict" else np.nan)
    for name in ("kl_verdict", "verdict"):
        board.loc[(board["versus"] == board["method"]).to_numpy(), name] = "baseline"
        board.loc[(aware & board[name].ne("baseline")).to_numpy() & board["versus"].notna().to_numpy(), name] = "answer-aware"

    ranks = []
    ranked = board[(board["method"] != REFERENCE) & ~aware & ~board["fewer_samples"]]
    boot = stats.Bootstrap.draw(frame, resamples, seed)
    _, kl_draws = boot.replicates(frame, "kl", order)
    for budget, group in ranked.groupby("budget", sort=True):
        first, expected = stats.rank_probabilities(-kl_draws[group.index.to_numpy()])  # lower KL ranks first
        ranks += [{"method": m, "budget": int(budget), "p_rank1": p, "expected_rank": e}
                  for m, p, e in zip(group["method"], first, expected)]
    return board, pd.DataFrame(ranks, columns=["method", "budget", "p_rank1", "expected_rank"])


def _insert_tests(board: pd.DataFrame, values: inference.Samples, pairs, names, at: int, lower_is_better: bool,
                  resamples_seed: int, rounded: np.ndarray | None = None, meaningful: float | None = None) -> None:
    """The comparison columns `names` (KL_TEST / SCORE_TEST) at column position `at`, one family for Holm."""
    tests = compare(values, pairs, seed=resamples_seed)
    columns = {name: np.full(len(board), np.nan) for name in names if name not in ("kl_verdict", "verdict")}
    delta, low, high, p, p_holm, verdict_name, mdd = names
    rows = [i for i, _ in pairs]
    for name, column in zip((delta, low, high, p, p_holm, mdd), ("delta", "low", "high", "p", "p_holm", "mdd")):
        columns[name][rows] = tests[column].to_numpy()
    if rounded is not None:  # scores: the difference of the rounded averages shown, its interval widened to hold it
        point = np.array([round(rounded[i] - rounded[j], 2) for i, j in pairs])
        columns[delta][rows] = point
        columns[low][rows] = _floor2(np.minimum(tests["low"].to_numpy(), point))
        columns[high][rows] = _ceil2(np.maximum(tests["high"].to_numpy(), point))
    based = [j for _, j in pairs]
    for j in set(based):  # the baseline's own row: a zero difference, no test
        columns[delta][j] = 0.0
    columns[verdict_name] = [inference.verdict(lo, hi, q, lower_is_better, d, meaningful)
                             for lo, hi, q, d in zip(columns[low], columns[high], columns[p_holm], columns[mdd])]
    for offset, name in enumerate(names):
        board.insert(at + offset, name, columns[name])


def length_buckets(frame: pd.DataFrame) -> tuple[pd.Series, tuple[str, ...], str] | None:
    """(bucket of each line, the bucket names, the unit the buckets cut), or None without lengths.

    A LongBench-E run uses the official buckets by words of context, 0-4k / 4-8k / 8k+. Other runs cut the
    samples' prompt tokens at their 1/3 and 2/3 quantiles (over the samples, each counted once): short is
    `<= q1`, medium `(q1, q2]`, long `> q2`, so the buckets' token ranges never overlap (a bucket need not
    hold every task, and samples of equal length always share one, so the thirds can be uneven)."""
    if all(is_longbench_e(task) for task in frame["task"].unique()) and "length" in frame.columns:
        length = pd.to_numeric(frame["length"], errors="coerce")
        if length.notna().any():
            return length.map(lambda n: length_bucket(n) if pd.notna(n) else None), LENGTH_BUCKETS, "words"
    if "prompt_tokens" not in frame.columns:
        return None
    tokens = pd.to_numeric(frame["prompt_tokens"], errors="coerce")
    samples = frame.assign(tokens=tokens).dropna(subset=["tokens"]).drop_duplicates(["task", "id"])
    if samples.empty:
        return None
    q1, q2 = np.quantile(samples["tokens"].to_numpy(float), [1 / 3, 2 / 3])
    names = np.where(tokens <= q1, TERCILES[0], np.where(tokens <= q2, TERCILES[1], TERCILES[2]))
    return pd.Series(np.where(tokens.notna(), names, None), index=frame.index), TERCILES, "prompt tokens"


def length_table(frame: pd.DataFrame, board: pd.DataFrame) -> pd.DataFrame | None:
    """lengths.csv: per method, budget and length bucket, the LongBench average over the tasks present in the
    bucket and the mean KL, with the bucket's samples, tasks and range of lengths (in `unit`); None without
    lengths."""
    found = length_buckets(frame)
    if found is None:
        return None
    buckets, names, unit = found
    measured = frame["length"] if unit == "words" else frame["prompt_tokens"]
    frame = frame.assign(bucket=buckets, measured=pd.to_numeric(measured, errors="coerce")).dropna(subset=["bucket"])
    per_task = frame.groupby(["method", "budget", "bucket", "task"], dropna=False, sort=False).agg(
        score=("score", lambda v: aggregate(list(v))), kl=("kl", "mean"), n=("id", "nunique"),
        lo=("measured", "min"), hi=("measured", "max"),
    ).reset_index()
    table = per_task.groupby(["method", "budget", "bucket"], dropna=False, sort=False).agg(
        length_min=("lo", "min"), length_max=("hi", "max"), samples=("n", "sum"), tasks=("task", "size"),
        avg=("score", "mean"), kl=("kl", "mean"),
    ).reset_index()
    table["avg"] = table["avg"].round(2)
    table["length_min"] = table["length_min"].astype(int)
    table["length_max"] = table["length_max"].astype(int)
    table.insert(table.columns.get_loc("length_max") + 1, "unit", unit)
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
