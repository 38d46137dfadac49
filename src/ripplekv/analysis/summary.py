"""The report as text: markdown views of the leaderboard and the differences, summary.md, and the rich
table `ripplekv eval` and `ripplekv report` print. Intervals are shown as `[low, high]` beside their value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ripplekv.analysis import stats
from ripplekv.analysis.tables import baseline_of, kl_verdict, verdict
from ripplekv.metrics.scoring import LENGTH_BUCKETS
from ripplekv.runs.files import REFERENCE


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
                     settings: dict | None = None, ceilings=()) -> str:
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
    marked = [m for m in dict.fromkeys(board["method"]) if m in set(ceilings or ())]
    if marked:
        lines += [f"Ceilings, not methods: {', '.join(f'`{m}`' for m in marked)} "
                  f"{'know' if len(marked) > 1 else 'knows'} the full cache's answer (a part of "
                  f"{'each' if len(marked) > 1 else 'it'} reads it), so "
                  f"{'they are' if len(marked) > 1 else 'it is'} left out of ranks; `headroom` is how far above the "
                  "best ranked method at its budget.", ""]
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
