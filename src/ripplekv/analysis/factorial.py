"""The factorial core of a study: allocation x scorer x head split, each factor's effect as its own row.

"LU-KV beats RippleKV" mixes three differences: how the budget is spread across layers (the allocation),
which entries a head keeps (the scorer) and how a layer's budget is shared by its KV heads (the split). A
study that runs every combination can say how much each one is worth. Each variant's cell is read from the
method it resolved to (`config.json`'s `method_specs`), never from its label:

- allocation: the allocator (a file allocation is named by its method);
- scorer: the scorer's name;
- split: the head split (`even` unless one is named; `curve` for LU-KV's own per-head counts).

The cells come from `methods.factors.design` (the pipeline reads them from a run's config and passes them in).
Every effect is a contrast of per-sample KL values (the same samples in every cell: paired), so it gets the
stratified t interval, the sign-flip p and the minimum detectable difference of `analysis.inference`, and
each budget's rows form one Holm family:

- a main effect: level b minus level a of one factor, averaged over every cell of the other two factors;
- an interaction: (b - a of one factor at the second level of another) minus (the same at its first level);
- a named pair of allocations (e.g. lukv vs ripplekv): their difference averaged over the scorer x split cells,
  then in each cell, then its interactions with scorer and split.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from ripplekv.analysis import inference

FACTORS = ("allocation", "scorer", "split")
COLUMNS = ["budget", "effect", "kind", "cells", "samples", "delta", "ci_low", "ci_high", "detectable", "p",
           "p_holm", "verdict"]


def complete_grid(cells: pd.DataFrame) -> pd.DataFrame:
    """The largest part of `cells` that is a full grid: the allocations present at every scorer x split level
    seen with two or more allocations (a lone extra level, such as LU-KV's own split, is left out)."""
    cells = cells.drop_duplicates(list(FACTORS))
    pairs = cells.groupby(["scorer", "split"])["allocation"].nunique()
    kept = [pair for pair, count in pairs.items() if count >= 2]
    cells = cells[[(s, p) in kept for s, p in zip(cells["scorer"], cells["split"])]]
    allocations = [a for a, group in cells.groupby("allocation", sort=False) if len(group) == len(kept)]
    return cells[cells["allocation"].isin(allocations)]


def contrasts(grid: pd.DataFrame, pair: tuple[str, str] | None = None,
              reference: str | None = None) -> list[tuple[str, str, dict]]:
    """(effect name, kind, {method label: weight}) for the main effects (allocations against `reference`, by
    default the first), two-way interactions of scorer and split, and the named allocation pair, over a
    complete grid."""
    label = {tuple(row[f] for f in FACTORS): row["method"] for _, row in grid.iterrows()}
    levels = {f: list(dict.fromkeys(grid[f])) for f in FACTORS}
    out = []

    def average(factor: str, first: str, second: str, fixed: dict | None = None) -> dict:
        others = [f for f in FACTORS if f != factor and f not in (fixed or {})]
        combos = list(itertools.product(*(levels[f] for f in others)))
        weights: dict = {}
        for combo in combos:
            where = {**dict(zip(others, combo)), **(fixed or {})}
            for level, sign in ((second, 1.0), (first, -1.0)):
                key = label[tuple({**where, factor: level}[f] for f in FACTORS)]
                weights[key] = weights.get(key, 0.0) + sign / len(combos)
        return weights

    def minus(a: dict, b: dict) -> dict:
        return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in dict.fromkeys([*a, *b])}

    for factor in ("scorer", "split"):
        for first, second in itertools.combinations(levels[factor], 2):
            out.append((f"{factor}: {second} - {first}", "main", average(factor, first, second)))
    allocations = levels["allocation"]
    reference = reference if reference in allocations else allocations[0]
    for allocation in levels["allocation"]:
        if allocation != reference:
            out.append((f"allocation: {allocation} - {reference}", "main",
                        average("allocation", reference, allocation)))
    if len(levels["scorer"]) == 2 and len(levels["split"]) == 2:
        (s1, s2), (p1, p2) = levels["scorer"], levels["split"]
        out.append((f"scorer x split: ({s2} - {s1}) at {p2} minus at {p1}", "interaction",
                    minus(average("scorer", s1, s2, {"split": p2}), average("scorer", s1, s2, {"split": p1}))))
    if pair and all(a in levels["allocation"] for a in pair):
        first, second = pair
        out.append((f"{second} - {first}", "pair", average("allocation", first, second)))
        for scorer, split in itertools.product(levels["scorer"], levels["split"]):
            out.append((f"{second} - {first} at {scorer}, {split}", "pair cell",
                        average("allocation", first, second, {"scorer": scorer, "split": split})))
        for factor in ("scorer", "split"):
            if len(levels[factor]) == 2:
                low, high = levels[factor]
                out.append((f"({second} - {first}) at {factor} {high} minus at {low}", "pair interaction",
                            minus(average("allocation", first, second, {factor: high}),
                                  average("allocation", first, second, {factor: low}))))
    return out


def effects(frame: pd.DataFrame, cells: pd.DataFrame, pair: tuple[str, str] | None = None, measure: str = "kl",
            meaningful: float | None = None, reference: str | None = None, seed: int = inference.SEED) -> pd.DataFrame:
    """Per budget, every contrast of `contrasts` on `measure` (columns COLUMNS) over `cells` (method, FACTORS:
    `methods.factors.design`). `meaningful`: the smallest effect the page calls meaningful; a tied row whose
    detectable difference exceeds it reads `underpowered`."""
    grid = complete_grid(cells)
    rows = []
    for budget in sorted(int(b) for b in frame["budget"].dropna().unique()):
        lines = frame[(frame["budget"] == budget) & frame["method"].isin(grid["method"])]
        cells = grid[grid["method"].isin(set(lines["method"]))]
        grid_here = complete_grid(cells)
        if grid_here["allocation"].nunique() < 2:
            continue
        keys = list(grid_here["method"])
        samples = inference.sample_matrix(lines.assign(key=lines["method"]), measure, keys)
        complete = np.isfinite(samples.values).all(axis=0)
        values, tasks = samples.values[:, complete], samples.tasks[complete]
        found = contrasts(grid_here, pair, reference)
        weights = np.array([[w.get(k, 0.0) for k in keys] for _, _, w in found])
        per_sample = weights @ values  # [contrasts, samples]
        estimate = inference.t_interval(per_sample, tasks)
        p = inference.sign_flip_p(per_sample, tasks, seed=seed)
        p_holm = inference.holm(p)
        detectable = estimate.detectable()
        for i, (name, kind, w) in enumerate(found):
            verdict = inference.verdict(estimate.low[i], estimate.high[i], p_holm[i], lower_is_better=True,
                                        detectable=detectable[i], meaningful=meaningful)
            rows.append({"budget": budget, "effect": name, "kind": kind,
                         "cells": sum(1 for v in w.values() if v != 0), "samples": int(complete.sum()),
                         "delta": estimate.point[i], "ci_low": estimate.low[i], "ci_high": estimate.high[i],
                         "detectable": detectable[i], "p": p[i], "p_holm": p_holm[i], "verdict": verdict})
    return pd.DataFrame(rows, columns=COLUMNS)


def effects_markdown(table: pd.DataFrame, measure: str = "KL") -> str:
    """The effects as a Markdown table, one section per budget."""
    if table.empty:
        return "No complete factorial grid in this run.\n"
    parts = []
    for budget, rows in table.groupby("budget", sort=True):
        parts.append(f"### B={budget}\n\n| effect | kind | n | {measure} difference [95% CI] | detectable | p | "
                     "Holm p | verdict |\n|---|---|---:|---|---:|---:|---:|---|")
        for row in rows.itertuples():
            parts.append(f"| {row.effect} | {row.kind} | {row.samples} | {row.delta:+.3f} [{row.ci_low:+.3f}, "
                         f"{row.ci_high:+.3f}] | {row.detectable:.3f} | {row.p:.2g} | {row.p_holm:.2g} | "
                         f"{row.verdict} |")
        parts.append("")
    return "\n".join(parts) + "\n"
