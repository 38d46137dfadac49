"""The allocation-only table: the run's methods that share the uniform baseline's scorer, paired against it.

A leaderboard row mixes an allocator with its own scorer, so "this allocator vs that one" cannot be read
off it. Here the rows are chosen from the run's resolved specs (config.json's `method_specs`): every
method whose scorer, name and options alike, is the uniform baseline's (`uniform`, else `snapkv`) differs
from it only in how the L x H_kv x B entries are spread over layers and heads. Each gets its KL to the full
cache and its score on the informative tasks, paired against the baseline at the same budget as the
leaderboard does (`analysis.inference`; Holm over the table's comparisons of each measure).

Rows of three kinds besides the allocators (`kind`):
- `answer-aware`: an allocation that reads the full cache's answer (the run's answer-aware labels). It is
  neither a deployable method nor a bound: attention the answer pays is not what the answer's KL needs, and
  learned allocators beat it. Shown for what it is, never ranked.
- `hindsight bound` (`best-of-allocations`): per sample, the lowest KL any allocation in the table reached,
  chosen knowing the answer: a bound on *selectors* among these allocations, not on allocation.
- `cross-fit` (`cross-fit choice`): an honest selector. Each task's samples are split in two halves
  (alternating by id); on one half the allocator (not answer-aware) with the lowest mean KL is chosen and its
  KL and score are taken on the other half, both ways round, so no sample judges the choice it made.

No allocator is judged against a best-of that contains it: `kl_gap_share` is the share of the baseline's
KL gap to the best-of *the other* allocations (leave-one-out, per sample) that a row closes,
`(baseline - row) / (baseline - best of the others)`, a point estimate, empty where that best-of is no
better than the baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis import inference
from ripplekv.analysis.headline import closest_pairs
from ripplekv.analysis.proportions import accuracy_tasks
from ripplekv.analysis.tables import BASELINES, KL_TEST, SCORE_TEST, _ceil2, _floor2, compare, fewer_samples
from ripplekv.runs.files import CONFIG, REFERENCE, is_ceiling

HINDSIGHT = "best-of-allocations"
CROSS_FIT = "cross-fit choice"
KINDS = {"method": "allocator", "aware": "answer-aware", "bound": "hindsight bound", "cross": "cross-fit"}
COLUMNS = ["budget", "method", "kind", "n", "fewer_samples", "kl", "kl_ci_low", "kl_ci_high", *KL_TEST, "kl_best_of_others", "kl_gap_share",
           "avg_informative", *SCORE_TEST, "picks"]


def method_specs(run_dir: str | Path) -> dict:
    """label -> resolved spec from a run's config.json ({} when it has none)."""
    path = Path(run_dir) / CONFIG
    try:
        return dict(json.loads(path.read_text()).get("method_specs") or {})
    except (OSError, ValueError):
        return {}


def same_scorer(specs: dict, present, declared: str | None = None) -> tuple[str | None, list[str]]:
    """(the baseline, every present method with exactly its scorer, baseline first); (None, []) without one."""
    present = list(dict.fromkeys(present))
    names = ((declared,) if declared else ()) + BASELINES
    base = next((name for name in names if name in present and "scorer" in specs.get(name, {})), None)
    if base is None:
        return None, []
    scorer = specs[base]["scorer"]
    chosen = [m for m in present if m != REFERENCE and specs.get(m, {}).get("scorer") == scorer]
    return base, [base] + [m for m in chosen if m != base]


def allocation_table(frame: pd.DataFrame, specs: dict, ceilings=None, counted: list[str] | None = None,
                     seed: int = inference.SEED, declared: str | None = None) -> pd.DataFrame | None:
    """The table (COLUMNS, one row per method and budget, then the bound and the cross-fit choice), or None
    when the run holds fewer than two allocators with the baseline's scorer. `ceilings`: the run's
    answer-aware labels (None: by name); `counted`: the tasks the score uses (default all)."""
    parts = allocation_parts(frame, specs, ceilings, counted, seed, declared)
    return None if parts is None else parts[0]


def allocation_headline(parts, seed: int = inference.SEED) -> pd.DataFrame:
    """Per budget, the allocator closest to the full cache and the runner-up (`analysis.headline`), from
    `allocation_parts`."""
    table, kl, score = parts
    candidates = (table["kind"] == KINDS["method"]) & ~table["fewer_samples"].astype(bool)
    return closest_pairs(table.assign(score=table["avg_informative"]), candidates, kl, score,
                         "allocation only", seed)


def allocation_parts(frame: pd.DataFrame, specs: dict, ceilings=None, counted: list[str] | None = None,
                     seed: int = inference.SEED, declared: str | None = None):
    """(the table, its rows' per-sample KL, their per-sample scores), or None (`allocation_table`)."""
    base, chosen = same_scorer(specs, frame["method"], declared)
    if base is None or len(chosen) < 2:
        return None
    rows = frame[frame["method"].isin(chosen) & frame["budget"].notna()]
    pairs_present = set(zip(rows["method"], rows["budget"].astype(int)))
    keys = [(m, int(b)) for b in sorted(rows["budget"].unique()) for m in chosen if (m, int(b)) in pairs_present]
    number = {key: i for i, key in enumerate(keys)}
    rows = rows.assign(score=100 * rows["score"], key=[number[(m, int(b))] for m, b in zip(rows["method"], rows["budget"])])
    counted = list(dict.fromkeys(rows["task"])) if counted is None else counted
    kl_all = inference.sample_matrix(rows, "kl", list(range(len(keys))), bounds=(0.0, np.inf))
    score_all = inference.sample_matrix(rows, "score", list(range(len(keys))), accuracy=accuracy_tasks(frame),
                                        bounds=(0.0, 100.0))
    score_all.values[:, ~np.isin([task for task, _ in score_all.ids], counted)] = np.nan
    meta, kl, score = [], [], []
    for budget in sorted({b for _, b in keys}):
        at = [i for i, (_, b) in enumerate(keys) if b == budget]
        methods = [keys[i][0] for i in at]
        if base not in methods:
            continue
        kl_b, score_b = kl_all.values[at], score_all.values[at]
        kinds = ["aware" if is_ceiling(m, ceilings) else "method" for m in methods]
        picks, cross_kl, cross_score = cross_fit(kl_all.rows(at), score_all.rows(at), [k == "method" for k in kinds], methods)
        with np.errstate(all="ignore"):
            bound = np.nanmin(kl_b, axis=0)  # per sample, the lowest KL of any allocation here
        first = len(meta)
        for k, (method, kind) in enumerate(zip(methods, kinds)):
            others = np.delete(kl_b, k, axis=0)
            with np.errstate(all="ignore"):
                best = inference.stratified_mean(np.nanmin(others, axis=0)[None, :], kl_all.tasks)[0]
            meta.append({"budget": budget, "method": method, "kind": KINDS[kind], "is_base": method == base,
                         "kl_best_of_others": best, "picks": "", "_b": first + methods.index(base)})
        meta.append({"budget": budget, "method": HINDSIGHT, "kind": KINDS["bound"], "is_base": False,
                     "kl_best_of_others": np.nan, "picks": "", "_b": first + methods.index(base)})
        meta.append({"budget": budget, "method": CROSS_FIT, "kind": KINDS["cross"], "is_base": False,
                     "kl_best_of_others": np.nan, "picks": picks, "_b": first + methods.index(base)})
        kl += [*kl_b, bound, cross_kl]
        score += [*score_b, np.full_like(bound, np.nan), cross_score]
    if not meta:
        return None
    table = pd.DataFrame(meta)
    kl = inference.Samples(np.vstack(kl), kl_all.tasks, kl_all.ids, None, kl_all.bounds)
    score = inference.Samples(np.vstack(score), kl_all.tasks, kl_all.ids, score_all.accuracy, score_all.bounds)
    estimate = inference.t_interval(kl.values, kl.tasks)
    low, high = inference.mean_interval(kl)
    n = np.isfinite(kl.values).sum(axis=1)
    table = table.assign(n=n, fewer_samples=fewer_samples(pd.Series(n)).to_numpy() & (table["kind"] == KINDS["method"]),
                         kl=estimate.point, kl_ci_low=low, kl_ci_high=high,
                         avg_informative=np.round(inference.stratified_mean(score.values, score.tasks), 2))
    base_kl = table["kl"].to_numpy()[table["_b"].to_numpy()]
    gap = base_kl - table["kl_best_of_others"].to_numpy()
    with np.errstate(all="ignore"):
        table["kl_gap_share"] = np.where(gap > 0, (base_kl - table["kl"].to_numpy()) / gap, np.nan)
    pairs = [(i, int(b)) for i, (b, base_row, kind) in enumerate(zip(table["_b"], table["is_base"], table["kind"]))
             if not base_row and kind != KINDS["bound"]]
    for names, values, lower in ((KL_TEST, kl, True), (SCORE_TEST, score, False)):
        _tests(table, names, values, pairs, lower, seed)
    return table.reindex(columns=COLUMNS), kl, score


def cross_fit(kl: inference.Samples, score: inference.Samples, eligible: list[bool], keys: list[str]):
    """(the picks, per-sample KL, per-sample score) of the two-fold cross-fitted choice (module docstring)."""
    present = np.isfinite(kl.values).any(axis=0)
    position = pd.Series(kl.tasks[present]).groupby(kl.tasks[present]).cumcount().to_numpy()
    half = np.zeros(len(present), dtype=bool)
    half[np.flatnonzero(present)] = position % 2 == 1
    kl_out, score_out, picks = np.full(len(half), np.nan), np.full(len(half), np.nan), []
    for chosen_on in (present & ~half, present & half):
        with np.errstate(all="ignore"):
            means = inference.stratified_mean(kl.values[:, chosen_on], kl.tasks[chosen_on])
        means = np.where(eligible & np.isfinite(means), means, np.inf)
        if not np.isfinite(means).any():
            continue
        pick = int(np.argmin(means))
        judged = present & ~chosen_on
        kl_out[judged] = kl.values[pick, judged]
        score_out[judged] = score.values[pick, judged]
        picks.append(keys[pick])
    if len(picks) == 2 and picks[0] == picks[1]:
        return f"{picks[0]} (both halves)", kl_out, score_out
    return " / ".join(picks), kl_out, score_out


def _tests(table: pd.DataFrame, names, values: inference.Samples, pairs, lower_is_better: bool, seed: int) -> None:
    """One measure's paired comparisons against each budget's baseline, one Holm family over the table."""
    delta, low, high, p, p_holm, verdict, mdd = names
    tests = compare(values, pairs, seed=seed)
    for name in (delta, low, high, p, p_holm, mdd):
        table[name] = np.nan
    rows = [i for i, _ in pairs]
    for name, source in zip((delta, low, high, p, p_holm, mdd), ("delta", "low", "high", "p", "p_holm", "mdd")):
        table.loc[rows, name] = tests[source].to_numpy()
    if not lower_is_better:  # scores: 2 decimals, the interval widened to hold the point shown
        point = np.round(tests["delta"].to_numpy(), 2)
        table.loc[rows, delta] = point
        table.loc[rows, low] = _floor2(np.minimum(tests["low"].to_numpy(), point))
        table.loc[rows, high] = _ceil2(np.maximum(tests["high"].to_numpy(), point))
    table[verdict] = [
        "baseline" if base else (KINDS["aware"] if kind == KINDS["aware"] else inference.verdict(
            lo, hi, q, lower_is_better, d, inference.MEANINGFUL["kl" if lower_is_better else "score"]))
        for base, kind, lo, hi, q, d in zip(table["is_base"], table["kind"], table[low], table[high], table[p_holm],
                                            table[mdd])]


def allocation_markdown(table: pd.DataFrame) -> str:
    """The table as markdown: fidelity first, differences with intervals, raw and Holm p, verdicts."""
    def paired(row, names, digits):
        delta, low, high, p, p_holm, verdict, _ = names
        if pd.isna(row[delta]):
            return row[verdict] or "", ""
        return (f"{row[delta]:+.{digits}f} [{row[low]:+.{digits}f}, {row[high]:+.{digits}f}]",
                f"{row[p]:.3g} ({row[p_holm]:.3g}) {row[verdict]}")

    def share(value):
        return "" if pd.isna(value) else f"{100 * value:.0f}%"

    lines = []
    for _, r in table.iterrows():
        kl_diff, kl_p = paired(r, KL_TEST, 3)
        score_diff, score_p = paired(r, SCORE_TEST, 2)
        label = r["method"] if r["kind"] in (KINDS["method"], KINDS["cross"]) else f"{r['method']} ({r['kind']})"
        if r["fewer_samples"]:
            label += " (fewer samples: not ranked)"
        lines.append({"budget": int(r["budget"]), "method": label + (f": {r['picks']}" if r["picks"] else ""),
                      "n": int(r["n"]),
                      "KL": f"{r['kl']:.3f}", "KL vs uniform [95% CI]": kl_diff, "p (Holm), verdict": kl_p,
                      "KL gap share (leave-one-out)": share(r["kl_gap_share"]),
                      "score": "" if pd.isna(r["avg_informative"]) else f"{r['avg_informative']:.2f}",
                      "score vs uniform [95% CI]": score_diff, "score p (Holm), verdict": score_p})
    return pd.DataFrame(lines).to_markdown(index=False, disable_numparse=True) + "\n"


def best_by_budget(table: pd.DataFrame) -> dict[int, str]:
    """Per budget, the allocator (not answer-aware, bound or cross-fit) closest to the full cache (lowest KL)."""
    real = table[(table["kind"] == KINDS["method"]) & ~table["fewer_samples"].astype(bool)]
    return {int(b): str(group.loc[group["kl"].idxmin(), "method"]) for b, group in real.groupby("budget")}
