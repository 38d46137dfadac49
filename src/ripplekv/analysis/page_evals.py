"""The results page's sections on the evals (`ripplekv reproduce`'s OUT/README.md; composed in results_page):
the headline per budget, the memory axis, the allocation-only table, head-to-head pairs, the context-only
protocol, the needle heatmap and the stages' time."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def _blank(table: pd.DataFrame) -> pd.DataFrame:
    """Missing cells as None, which markdown shows as a dash (a NaN would read "nan")."""
    return table.astype(object).where(table.notna(), None)


def _paired(point, low, high, digits: int) -> str:
    return "–" if pd.isna(point) else f"{point:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _p(raw, adjusted) -> str:
    return "–" if pd.isna(raw) else f"{raw:.2g} (Holm {adjusted:.2g})"


def _word(value) -> str:
    return value if isinstance(value, str) and value else "–"


def _headline_table(rows: pd.DataFrame, board: pd.DataFrame | None) -> str:
    """Per budget: closest to full and the runner-up by KL, their paired difference, p (Holm) and verdict;
    the closest one against the uniform baseline (from the leaderboard); both scores on informative tasks."""
    lines = []
    for r in rows.itertuples():
        line = {"budget": int(r.budget), "closest to full (KL)": f"`{r.closest}` {r.closest_kl:.3f}",
                "runner-up (KL)": f"`{r.runner_up}` {r.runner_up_kl:.3f}",
                "KL difference [95% CI]": _paired(r.kl_delta, r.kl_ci_low, r.kl_ci_high, 3),
                "p": _p(r.p_kl, r.p_kl_holm), "verdict": _word(r.kl_verdict)}
        if board is not None:
            own = board[(board["method"] == r.closest) & (board["budget"] == r.budget)]
            if len(own) and pd.notna(own["kl_delta_vs_uniform"].iloc[0]):
                o = own.iloc[0]
                line[f"closest vs `{o['versus']}`: KL [95% CI], verdict"] = (
                    f"{_paired(o['kl_delta_vs_uniform'], o['kl_delta_ci_low'], o['kl_delta_ci_high'], 3)} {_word(o['kl_verdict'])}")
        line["scores, informative tasks (closest vs runner-up)"] = (
            "–" if pd.isna(r.closest_score) else
            f"{r.closest_score:.2f} vs {r.runner_up_score:.2f}: {_paired(r.score_delta, r.score_ci_low, r.score_ci_high, 2)}, "
            f"{_word(r.score_verdict)}")
        lines.append(line)
    return pd.DataFrame(lines).to_markdown(index=False)


def _tied_sentence(rows: pd.DataFrame) -> str:
    """Which budgets' closest method the data cannot tell from its runner-up: tied, or underpowered (this n could
    not detect a difference of the meaningful size)."""
    tied = [f"B={int(r.budget)}" for r in rows.itertuples() if r.kl_verdict == "tied"]
    weak = [f"B={int(r.budget)}" for r in rows.itertuples() if r.kl_verdict == "underpowered"]
    other = [f"B={int(r.budget)}" for r in rows.itertuples() if r.kl_verdict not in ("closer", "tied", "underpowered")]
    if not tied and not weak and not other:
        return "At every budget the closest method is closer than its runner-up (Holm-adjusted p < 0.05)."
    parts = []
    if tied:
        parts.append(f"Tied at {', '.join(tied)}: there the closest method and the runner-up are tied (the interval "
                     "holds 0 or the adjusted p is 0.05 or more, and this n could detect the meaningful difference).")
    if weak:
        parts.append(f"Underpowered at {', '.join(weak)}: the difference is not significant and its minimum detectable "
                     "size (80% power) is above the meaningful effect, so these samples cannot say either way.")
    if other:
        parts.append(f"Not compared at {', '.join(other)}.")
    return " ".join(parts) + " Where not `closer`, neither method is the winner."


def headline_lines(eval_dir: Path, title: str) -> list[str]:
    """The eval's headline.csv (`ripplekv report`): per budget, the real method closest to the full cache, the
    runner-up and whether they differ; and which tasks the score averages use."""
    path = eval_dir / "headline.csv"
    if not path.is_file():
        return []
    table = pd.read_csv(path)
    rows = table[table["scope"] == "all methods"]
    if rows.empty:
        return []
    board = pd.read_csv(eval_dir / "leaderboard.csv") if (eval_dir / "leaderboard.csv").is_file() else None
    lines = ["", f"## {title}", "",
             "Fidelity first: per budget, the real method with the lowest mean KL to the full cache (answer-aware "
             "variants excluded), the runner-up, and their paired difference: stratified t interval, sign-flip "
             "permutation p, Holm-adjusted over the budgets (accuracies: Wilson intervals, Tango's paired score interval "
             "for differences). `closer` only where the adjusted p < 0.05 and the interval excludes 0; else `tied`, or "
             "`underpowered` where the minimum detectable difference is above the meaningful effect (KL 0.05, score 5 "
             "points). Scores are on the informative tasks only, compared the same way; no score winner is named.", "", _headline_table(rows, board), "", _tied_sentence(rows)]
    lines += informative_lines(eval_dir)
    return lines


def memory_lines(out: Path) -> list[str]:
    """The memory axis (OUT/eval-memory, when MEMORY_METHODS ran): per budget, the way of spending its bytes
    closest to the full cache against the runner-up (tied where their interval holds 0), then every variant."""
    run = out / "eval-memory"
    table = run / "memory_axis.md"
    if not table.is_file():
        return []
    lines = headline_lines(run, "Memory axis: the best way found to spend each budget's bytes")
    body = [line for line in table.read_text().splitlines() if not line.startswith("## ")]
    return lines + ["", "Every variant at matched bytes (`eval-memory/memory_axis.csv`):", *body,
                    "![memory axis](eval-memory/memory_axis.png)"]


def informative_lines(eval_dir: Path) -> list[str]:
    """One sentence: the tasks that count in the score averages and those flagged out, with their numbers."""
    path = eval_dir / "informative.csv"
    if not path.is_file():
        return []
    table = pd.read_csv(path)
    known = table[table["informative"].notna()]
    if known.empty:
        return []
    yes = [t for t, v in zip(known["task"], known["informative"]) if str(v) == "True"]
    no = known[known["informative"].astype(str) == "False"]
    flagged = "; ".join(f"{r.task} (full cache {r.full_score:.2f}, best constant answer {r.trivial_score:.2f})"
                        for r in no.itertuples())
    return ["", f"Informative tasks (the full cache beats the best constant answer, one-sided 95%): {', '.join(yes) or 'none'}."
            + (f" Flagged, kept in the tables but out of the score averages: {flagged}." if flagged else "")]


def allocation_lines(eval_dir: Path) -> list[str]:
    """The allocation-only table (`eval/allocation_only.csv`, written by `ripplekv report` when several methods share
    the uniform baseline's scorer), with its headline: per budget the allocator closest to the full cache and the
    runner-up, and RippleKV's share of the gap to the best of the other allocations."""
    path = eval_dir / "allocation_only.csv"
    if not path.is_file():
        return []
    from ripplekv.analysis.allocation import allocation_markdown
    from ripplekv.defaults import ALLOCATION_METHOD

    table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    table["picks"] = table["picks"].fillna("")
    table["verdict"] = table["verdict"].fillna("")
    table["kl_verdict"] = table["kl_verdict"].fillna("")
    headline = pd.read_csv(eval_dir / "headline.csv") if (eval_dir / "headline.csv").is_file() else pd.DataFrame()
    rows = headline[headline["scope"] == "allocation only"] if len(headline) else headline
    names = [f"`{m}`" for m in dict.fromkeys(table.loc[table["kind"] == "answer-aware", "method"])]
    aware = (", ".join(names) + (" are" if len(names) > 1 else " is")) if names else ""
    shares = []
    for budget, group in table.groupby("budget"):
        ours = group[group["method"] == ALLOCATION_METHOD]
        if len(ours) and pd.notna(ours["kl_gap_share"].iloc[0]):
            shares.append(f"B={int(budget)} {100 * ours['kl_gap_share'].iloc[0]:.0f}%")
    return ["", "## Allocation only (one scorer, every allocator)", "",
            "Every method here uses the uniform baseline's scorer, so rows differ only in how the L x H_kv x B entries "
            "are spread over layers and heads; each is paired against uniform at the same budget (t interval, sign-flip "
            "p, Holm over the table). " + (f"{aware} answer-aware: an allocation chosen from the answer's attention, "
                                           "neither a method nor a bound. " if aware else "")
            + "`best-of-allocations` is a hindsight bound on selectors: per "
            "sample the lowest KL any allocation here reached. No allocator is judged against a best-of that contains "
            "it: `KL gap share` is the share of uniform's KL gap to the best of the *other* allocations (leave-one-out, "
            "a point estimate). `cross-fit choice` is an honest selector: the allocator with the lowest KL on one half "
            "of each task's samples, measured on the other half, both ways.", "",
            *([_headline_table(rows, None), "", _tied_sentence(rows)] if len(rows) else []),
            *([f"`{ALLOCATION_METHOD}`'s share of uniform's KL gap to the best of the other allocations: "
               + ", ".join(shares) + " (above 100%: closer than that per-sample best of the others on average)."]
              if shares else []),
            "", allocation_markdown(table)]


def head_to_head_lines(eval_dir: Path) -> list[str]:
    """Paired differences of each HEAD_TO_HEAD pair present in the eval, per budget with intervals."""
    board = eval_dir / "leaderboard.csv"
    present = set(pd.read_csv(board)["method"]) if board.is_file() else set()
    from ripplekv.defaults import HEAD_TO_HEAD

    if not any(method in present and versus in present for method, versus in HEAD_TO_HEAD):
        return []
    from ripplekv.analysis.informative import counted_tasks
    from ripplekv.analysis.pairs import head_to_head, head_to_head_markdown
    from ripplekv.analysis.report import load_predictions

    frame = load_predictions(eval_dir)
    informative = eval_dir / "informative.csv"
    counted = counted_tasks(pd.read_csv(informative, dtype={"informative": "boolean"})) if informative.is_file() else None
    lines = []
    for method, versus in HEAD_TO_HEAD:
        table = head_to_head(frame, method, versus, counted=counted)
        if not table.empty:
            lines += ["", f"## `{method}` against `{versus}`", "",
                      f"Paired differences over the samples both ran (`{method}` minus `{versus}`; a negative KL and a "
                      "positive score favour the first; scores on the informative tasks): t interval, sign-flip p, Holm "
                      "over the budgets; `tied` unless the adjusted p < 0.05 and the interval excludes 0.", "",
                      head_to_head_markdown(table)]
    return lines


def time_lines(out: Path) -> list[str]:
    """How long each stage of this run took (OUT/stages.csv, written by the staged runner)."""
    path = out / "stages.csv"
    if not path.is_file():
        return []
    stages = pd.read_csv(path)
    table = stages.assign(minutes=(stages["seconds"] / 60).round(1))[["stage", "minutes"]]
    return ["", "## Time", "", f"Stages as run (a resumed stage is listed once per run), {stages['seconds'].sum() / 60:.1f} "
            "minutes in all:", "", table.to_markdown(index=False)]


def context_only_lines(out: Path) -> list[str]:
    """The context-only protocol's leaderboard (its own eval folder), when the run made it."""
    eval_dir = out / "eval-context-only"
    path = eval_dir / "leaderboard.csv"
    if not path.is_file():
        return []
    board = pd.read_csv(path)
    columns = [c for c in ("method", "budget", "n", "kl", "agreement", "kl_delta_vs_uniform", "kl_delta_ci_low",
                           "kl_delta_ci_high", "p_kl_vs_uniform_holm", "kl_verdict", "avg_informative", "avg") if c in board]
    config = json.loads((eval_dir / "config.json").read_text())
    count = sum(len(ids) for ids in config.get("samples", {}).values())
    return [*headline_lines(eval_dir, "Headline, context-only protocol"), "",
            "## Context-only protocol",
            "",
            f"The context compressed alone (its observation window is the end of the context), the question then "
            f"read through each compressed cache, as a cache reused across questions would be (kvpress's default): "
            f"{count} samples, the first of each task's evaluation samples. Full table: `eval-context-only/`.",
            "",
            _blank(board[columns]).to_markdown(index=False, floatfmt=".4g", missingval="–")]


NEEDLE_CELL_SAMPLES = 10  # below this many samples a cell, the heatmap is labelled illustrative


def needle_lines(out: Path) -> list[str]:
    """The needle heatmap (OUT/needle, `ripplekv needle`), when the run made it: its figure and samples per cell."""
    grid_path = out / "needle" / "needle.csv"
    if not grid_path.is_file():
        return []
    grid = pd.read_csv(grid_path)
    figures = sorted(p.name for p in (out / "needle").glob("needle_b*.png"))
    full = grid[grid["budget"].isna()]
    by_length = full.groupby("length").agg(samples=("n", "sum"), accuracy=("accuracy", "mean")).reset_index()
    fewest = int(full["n"].min()) if len(full) else 0
    illustrative = (f"**Illustrative only:** {fewest} sample(s) a cell, fewer than the {NEEDLE_CELL_SAMPLES} a cell "
                    "needs before one cell may be read against another. " if fewest < NEEDLE_CELL_SAMPLES else "")
    return ["", "## Needle by depth and length" + (" (illustrative)" if illustrative else ""), "",
            f"{illustrative}RULER's niah_single_2 with the needle at each depth in turn, {int(full['n'].sum())} samples over "
            f"{len(by_length)} lengths; accuracy (top) and KL to the full cache (bottom) per method, a cell per "
            "depth and target length (blank: no sample). Grid: `needle/needle.csv`. Full cache by length:", "",
            by_length.to_markdown(index=False, floatfmt=".4g"), "",
            *[f"![needle heatmap](needle/{name})" for name in figures]]
