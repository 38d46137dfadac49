"""The allocation-only table: the run's methods that share the uniform baseline's scorer, paired against it.

A leaderboard row mixes an allocator with its own scorer, so "this allocator vs that one" cannot be read
off it. Here the rows are chosen from the run's resolved specs (config.json's `method_specs`): every
method whose scorer, name and options alike, is the uniform baseline's (`uniform`, else `snapkv`) differs
from it only in how the L x H_kv x B entries are spread over layers and heads. Each gets its score and KL
to the full cache with their paired bootstrap differences to the baseline at the same budget (the
leaderboard's own `stats`), and the share of the baseline-to-ceiling gap it closes: (baseline - method) /
(baseline - ceiling) for KL, (method - baseline) / (ceiling - baseline) for the score; a point estimate (a
ratio of two noisy differences has no stable percentile interval on a few samples), left empty where the
ceiling is no better than the baseline.

The ceiling is `best-of-allocations`: per sample and budget, the lowest KL (and, separately, the highest
score) any allocation in the table reached, the answer-aware `allocation-ceiling` included. It is chosen in
hindsight, knowing the answer, so no row can beat it on average and every share is at most 100%. It bounds
the allocations tried, not every possible one: a better allocation may exist, so the true gap is at least
this large. (The answer-aware competition alone is no ceiling: attention the answer pays is not what the
answer's KL needs, and on the bundled model learned allocators beat it.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ripplekv.analysis import stats
from ripplekv.analysis.tables import BASELINES, _ceil2, _floor2
from ripplekv.runs.files import CONFIG, REFERENCE, is_ceiling

HINDSIGHT = "best-of-allocations"
COLUMNS = ["method", "budget", "ceiling", "avg", "delta_vs_uniform", "delta_ci_low", "delta_ci_high", "kl",
           "kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high", "kl_gap_closed", "score_gap_closed"]


def method_specs(run_dir: str | Path) -> dict:
    """label -> resolved spec from a run's config.json ({} when it has none)."""
    path = Path(run_dir) / CONFIG
    try:
        return dict(json.loads(path.read_text()).get("method_specs") or {})
    except (OSError, ValueError):
        return {}


def same_scorer(specs: dict, present) -> tuple[str | None, list[str]]:
    """(the baseline, every present method with exactly its scorer, baseline first); (None, []) without one."""
    present = list(dict.fromkeys(present))
    base = next((name for name in BASELINES if name in present and "scorer" in specs.get(name, {})), None)
    if base is None:
        return None, []
    scorer = specs[base]["scorer"]
    chosen = [m for m in present if m != REFERENCE and specs.get(m, {}).get("scorer") == scorer]
    return base, [base] + [m for m in chosen if m != base]


def allocation_table(frame: pd.DataFrame, specs: dict, resamples: int = stats.RESAMPLES,
                     seed: int = stats.SEED, ceilings=None) -> pd.DataFrame | None:
    """The table (COLUMNS, one row per method and budget), or None when the run holds fewer than two
    allocators with the baseline's scorer. `ceilings`: the run's answer-aware labels (None: by name)."""
    base, chosen = same_scorer(specs, frame["method"])
    if base is None or len(chosen) < 2:
        return None
    rows = frame[frame["method"].isin(chosen) & frame["budget"].notna()]
    rows = pd.concat([rows, hindsight_rows(rows)], ignore_index=True)
    chosen = chosen + [HINDSIGHT]
    keys = list(rows.groupby(["method", "budget"], sort=False).groups)
    index = {key: i for i, key in enumerate(keys)}
    rows = rows.assign(key=[index[(m, b)] for m, b in zip(rows["method"], rows["budget"])])
    boot = stats.Bootstrap.draw(rows, resamples, seed)
    order = list(range(len(keys)))
    score, score_draws = (100 * x for x in boot.replicates(rows, "score", order))
    kl, kl_draws = boot.replicates(rows, "kl", order)
    out = []
    for budget in sorted({b for _, b in keys}):
        if (base, budget) not in index:
            continue
        b = index[(base, budget)]
        c = index.get((HINDSIGHT, budget))
        for method in chosen:
            if (method, budget) not in index:
                continue
            i = index[(method, budget)]
            row = {"method": method, "budget": int(budget), "ceiling": method == HINDSIGHT or is_ceiling(method, ceilings),
                   "avg": round(float(score[i]), 2), "kl": float(kl[i])}
            if i != b:
                diff, kl_diff = score_draws[i] - score_draws[b], kl_draws[i] - kl_draws[b]
                point = round(float(score[i] - score[b]), 2)
                low, high = stats.interval(diff)
                row.update(delta_vs_uniform=point, delta_ci_low=float(_floor2(min(low, point))),
                           delta_ci_high=float(_ceil2(max(high, point))))
                kl_point = float(kl[i] - kl[b])
                low, high = stats.interval(kl_diff)
                row.update(kl_delta_vs_uniform=kl_point, kl_delta_ci_low=float(min(low, kl_point)),
                           kl_delta_ci_high=float(max(high, kl_point)))
            if c is not None and kl[b] > kl[c]:
                row["kl_gap_closed"] = float((kl[b] - kl[i]) / (kl[b] - kl[c]))
            if c is not None and score[c] > score[b]:
                row["score_gap_closed"] = float((score[i] - score[b]) / (score[c] - score[b]))
            out.append(row)
    return pd.DataFrame(out).reindex(columns=COLUMNS)


def hindsight_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """`best-of-allocations`: per (task, sample, budget), the lowest KL and the highest score of any row."""
    best = rows.groupby(["task", "id", "budget"], as_index=False).agg(kl=("kl", "min"), score=("score", "max"))
    return best.assign(method=HINDSIGHT)


def allocation_markdown(table: pd.DataFrame) -> str:
    """The table as markdown: differences with their intervals, gap shares as percentages."""
    def paired(row, point, low, high, digits):
        if pd.isna(row[point]):
            return "(baseline)"
        return f"{row[point]:+.{digits}f} [{row[low]:+.{digits}f}, {row[high]:+.{digits}f}]"

    def share(value):
        return "" if pd.isna(value) else f"{100 * value:.0f}%"

    lines = [{"budget": int(r["budget"]), "method": f"{r['method']}{' (ceiling)' if r['ceiling'] else ''}",
              "score": f"{r['avg']:.2f}", "score vs uniform [95% CI]": paired(r, "delta_vs_uniform", "delta_ci_low", "delta_ci_high", 2),
              "KL": f"{r['kl']:.3f}", "KL vs uniform [95% CI]": paired(r, "kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high", 3),
              "KL gap closed": share(r["kl_gap_closed"]), "score gap closed": share(r["score_gap_closed"])}
             for _, r in table.iterrows()]
    return pd.DataFrame(lines).to_markdown(index=False) + "\n"


def best_by_budget(table: pd.DataFrame) -> dict[int, str]:
    """Per budget, the real (not ceiling) allocator closest to the full cache (lowest KL)."""
    real = table[~table["ceiling"].astype(bool)]
    return {int(b): str(group.loc[group["kl"].idxmin(), "method"]) for b, group in real.groupby("budget")}

