"""The report as text: markdown views of the leaderboard and the differences, summary.md, and the rich
table `ripplekv eval` and `ripplekv report` print. Intervals are shown as `[low, high]` beside their value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ripplekv.analysis import inference, stats
from ripplekv.analysis.headline import headline_markdown
from ripplekv.analysis.over_budget import COLUMN as OVER_BUDGET
from ripplekv.analysis.over_budget import THRESHOLD_COLUMN as THRESHOLD
from ripplekv.analysis.over_budget import note as over_budget_note
from ripplekv.analysis.over_budget import shown as with_over_budget
from ripplekv.analysis.small_fits import RECORDS, small_fits
from ripplekv.analysis.small_fits import note as small_fit_note
from ripplekv.analysis.small_fits import shown as with_small_fit
from ripplekv.analysis.tables import KL_RATIO, KL_TEST, SCORE_TEST
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
    """The leaderboard for reading, fidelity first: intervals as `[low, high]` next to their value, no test
    columns (those are in the differences view)."""
    tests = [*KL_TEST, *KL_RATIO, *SCORE_TEST, "versus", "informative_tasks", "fewer_samples"]
    view = board.drop(columns=[c for c in tests if c in board])
    view["kl"] = view["kl"].map(lambda v: f"{v:.3g}")
    view["agreement"] = view["agreement"].map(lambda v: f"{v:.3f}")
    for name, digits in (("kl", ".3g"), ("agreement", ".3f"), ("avg_informative", ".2f"), ("avg", ".2f")):
        view.insert(view.columns.get_loc(f"{name}_ci_low"), f"{name} 95% CI",
                    [_interval(a, b, digits) for a, b in zip(board[f"{name}_ci_low"], board[f"{name}_ci_high"])])
        view = view.drop(columns=[f"{name}_ci_low", f"{name}_ci_high"])
    return with_small_fit(with_over_budget(view)).rename(columns={"avg_informative": "score (informative)", "avg_informative 95% CI": "score 95% CI",
                                "avg": "avg (all tasks)", "avg 95% CI": "avg 95% CI"})


def leaderboard_sections(board: pd.DataFrame) -> list[str]:
    """The leaderboard's markdown lines: the rows on the table's n, then those with fewer samples apart (unranked)."""
    apart = board["fewer_samples"].astype(bool).to_numpy() if "fewer_samples" in board else None
    if apart is None or not apart.any():
        return [markdown_table(leaderboard_view(board)), ""]
    return [markdown_table(leaderboard_view(board[~apart])), "",
            f"Rows with fewer samples than the table's n ({int(board['n'].max())}), not ranked:", "",
            markdown_table(leaderboard_view(board[apart])), ""]


def differences_view(board: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """Per budget and compressed method: its paired differences to the baseline, KL first, with interval, raw
    and Holm-adjusted p and verdict; then rank probabilities."""
    rows = board[board["method"] != REFERENCE].merge(ranks, on=["method", "budget"], how="left")

    def p(raw, adjusted):
        return "–" if pd.isna(raw) else f"{raw:.3g} ({adjusted:.3g})"

    return pd.DataFrame({
        "budget": rows["budget"],
        "method": rows["method"],
        "n": rows["n"] if "n" in rows else "–",
        "vs": rows["versus"].fillna("–"),
        "KL difference": rows["kl_delta_vs_uniform"].map(lambda v: "–" if pd.isna(v) else f"{v:+.3f}"),
        "KL 95% CI": [_interval(a, b, ".3f") for a, b in zip(rows["kl_delta_ci_low"], rows["kl_delta_ci_high"])],
        "KL p (Holm)": [p(a, b) for a, b in zip(rows["p_kl_vs_uniform"], rows["p_kl_vs_uniform_holm"])],
        "KL verdict": rows["kl_verdict"].replace("", "–").fillna("–"),
        "score difference": rows["delta_vs_uniform"].map(lambda v: "–" if pd.isna(v) else f"{v:+.2f}"),
        "score 95% CI": [_interval(a, b) for a, b in zip(rows["delta_ci_low"], rows["delta_ci_high"])],
        "score p (Holm)": [p(a, b) for a, b in zip(rows["p_vs_uniform"], rows["p_vs_uniform_holm"])],
        "score verdict": rows["verdict"].replace("", "–").fillna("–"),
        "P(rank 1)": rows["p_rank1"],
        "expected rank": rows["expected_rank"],
    })


def detectable_line(board: pd.DataFrame) -> str:
    """The minimum detectable differences of the table's comparisons, as one sentence."""
    def median(column):
        values = board[column].dropna() if column in board else pd.Series(dtype=float)
        return values.median() if len(values) else None

    kl, score = median("kl_mdd"), median("score_mdd")
    if kl is None:
        return ""
    said = f"KL {kl:.3f}" + (f", score {score:.2f} points" if score is not None else "")
    meaningful = inference.MEANINGFUL
    return (f"Minimum detectable difference at this n (median over the comparisons; `(t_0.975,df + t_0.8,df) x SE` "
            f"of each paired difference, 80% power at alpha 0.05, per row in `kl_mdd` / `score_mdd`): {said}. "
            f"The smallest effect this page calls meaningful: KL {meaningful['kl']:g}, score {meaningful['score']:g} "
            "points; a difference that is not significant reads `underpowered` where its detectable difference "
            "exceeds that, `tied` only where this n could have seen it.")


def informative_view(informative: pd.DataFrame) -> pd.DataFrame:
    """informative.csv for reading: the trivial answer cut to 40 characters."""
    def cut(text):
        if not isinstance(text, str):
            return "–"
        flat = " ".join(text.split())
        return "`" + (flat[:40] + "…" if len(flat) > 40 else flat).replace("|", "\\|") + "`"

    return pd.DataFrame({
        "task": informative["task"], "samples": informative["samples"], "full cache": informative["full_score"],
        "best constant answer": informative["trivial_answer"].map(cut), "its score": informative["trivial_score"],
        "margin (one-sided 95% low)": [_interval(m, lo, ".2f").replace(", ", " (").replace("]", ")").strip("[")
                                       if pd.notna(m) else "–" for m, lo in zip(informative["margin"], informative["margin_low"])],
        "informative": informative["informative"].map(lambda v: "–" if pd.isna(v) else ("yes" if v else "no")),
    })


def summary_markdown(frame: pd.DataFrame, board: pd.DataFrame, wide: pd.DataFrame, run_dir: Path,
                     ranks: pd.DataFrame | None = None, lengths: pd.DataFrame | None = None,
                     settings: dict | None = None, ceilings=(), headline: pd.DataFrame | None = None,
                     informative: pd.DataFrame | None = None) -> str:
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
    tokens = pd.to_numeric(samples["prompt_tokens"], errors="coerce") if "prompt_tokens" in samples else pd.Series(dtype=float)
    lines += [
        f"{len(samples)} samples over {samples['task'].nunique()} tasks"
        + (f"; prompts of {int(tokens.min())}-{int(tokens.max())} tokens." if tokens.notna().any() else "."),
        "ROUGE-L: " + ("official (`rouge` package, LongBench parity)." if rouge == "official"
                       else "Google's `rouge-score` (rougeL F1, Porter stemmer) instead of the official scorer."),
        "",
        "How to read the numbers: fidelity (`kl`, KL(full || variant) per answer token along the full cache's answer; "
        "`agreement`, the share of those tokens the variant also predicts) is the primary outcome; scores follow. "
        "Means are over tasks of per-task means; 95% intervals are stratified t intervals, except on accuracies "
        "(tasks scored 0 or 1 per sample: " + (", ".join(f"`{t}`" for t in settings.get("accuracy_tasks", [])) or "none here")
        + "), where a mean gets Wilson's interval and a paired difference Tango's score interval (MOVER over tasks), so no "
        "interval leaves [0, 100]; every interval is cut to its scale. Each difference is paired "
        "(the same samples on both sides) and tested by a sign-flip permutation test stratified by task "
        f"(every sign pattern counted up to {inference.EXACT_LIMIT} nonzero differences: exact p; beyond, "
        f"{settings.get('permutations', inference.PERMUTATIONS)} random patterns, "
        f"{settings.get('refined_permutations', inference.REFINED_PERMUTATIONS)} where p is within a factor 2 of "
        "a Holm threshold); p-values are shown raw and Holm-adjusted over every comparison of the table (per "
        "measure). `better` / `worse` (`closer` / `further` for KL) only where the adjusted p is below 0.05 and "
        "the interval excludes 0; otherwise `underpowered` where the comparison's minimum detectable difference "
        "exceeds the meaningful effect, `tied` where it does not. `n`: the samples a row stands on; a row with "
        "fewer than its table's n is listed apart and never ranked.",
        "",
    ]
    if headline is not None and len(headline):
        lines += ["## Headline", "",
                  "Per budget, the real method closest to the full cache (lowest mean KL), the runner-up, and their paired "
                  "difference (Holm over the budgets); their scores on the informative tasks, compared the same way.", "",
                  headline_markdown(headline[headline["scope"] == headline["scope"].iloc[0]]), ""]
    if informative is not None and len(informative):
        lines += ["## Informative tasks", "",
                  "A task counts in the score averages (`score (informative)`) when the full cache beats the best constant "
                  "answer (picked in hindsight among the task's full-cache predictions and gold answers) with a one-sided 95% "
                  "lower bound above 0; the others stay in the tables (`avg`, per task), flagged.", "",
                  markdown_table(informative_view(informative)), ""]
    lines += [
        "## Leaderboard",
        "",
        "Ranks are per budget among compressed methods by mean KL (1 = closest to the full cache); `full` is the "
        f"reference and unranked. `rank` P(rank 1) and expected rank come from {settings.get('resamples', stats.RESAMPLES)} "
        f"paired bootstrap resamples of the samples within each task (seed {settings.get('seed', stats.SEED)}).",
        "",
        *leaderboard_sections(board),
    ]
    marked = [m for m in dict.fromkeys(board["method"]) if m in set(ceilings or ())]
    if marked:
        lines += [f"Answer-aware, not methods: {', '.join(f'`{m}`' for m in marked)} "
                  f"{'read' if len(marked) > 1 else 'reads'} the full cache's answer, so "
                  f"{'they are' if len(marked) > 1 else 'it is'} left out of ranks and verdicts; "
                  "none is a bound on what a method can reach.", ""]
    if OVER_BUDGET in board:  # the variants kept over their budget (`analysis.over_budget`)
        flagged = board[OVER_BUDGET].astype(bool)
        by_threshold = board[THRESHOLD].astype(bool) if THRESHOLD in board else flagged & False
        lines += over_budget_note(board.loc[flagged, "method"], board["method"], set(board.loc[by_threshold, "method"]))
    lines += small_fit_note(small_fits(settings.get(RECORDS) or {}), board["method"])
    if ranks is not None:
        lines += [
            "## Differences to the uniform baseline",
            "",
            "The primary comparisons: each compressed method against the budget's baseline (`vs`), paired. "
            + detectable_line(board),
            "",
            markdown_table(differences_view(board, ranks)),
            "",
        ]
    if lengths is not None:
        buckets = list(dict.fromkeys(lengths["bucket"]))
        keys = pd.MultiIndex.from_frame(board[["method", "budget"]])
        parts = []
        for value, name in (("kl", "KL"), ("avg", "avg")):
            part = lengths.pivot_table(index=["method", "budget"], columns="bucket", values=value, sort=False, dropna=False)
            parts.append(part.reindex(keys)[buckets].rename(columns=lambda b, name=name: f"{name} {b}"))
        by_length = pd.concat(parts, axis=1).reset_index()
        by_length.columns.name = None
        reference = lengths[lengths["method"] == lengths["method"].iloc[0]]
        described = ", ".join(f"{r.bucket}: {r.samples} samples of {r.length_min}-{r.length_max} {r.unit}"
                              for r in reference.itertuples())
        how = ("LongBench-E buckets" if set(buckets) <= set(LENGTH_BUCKETS)
               else "the samples cut at the 1/3 and 2/3 quantiles of their prompt tokens, so buckets never overlap")
        lines += ["## By context length", "", f"KL and average score (all tasks present) by context length ({how}; "
                  f"{described}).", "",
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


def summary_table(board: pd.DataFrame, title: str = "kl (score) by method and budget"):
    """A rich table: methods x budgets, each cell `kl (score)`, the score on the informative tasks when the run
    has them; marked when the KL is significantly closer or further than the baseline's after Holm's adjustment."""
    from rich.table import Table

    budgets = sorted(int(b) for b in board["budget"].dropna().unique())
    marked = "kl_verdict" in board
    score = "avg_informative" if "avg_informative" in board and board["avg_informative"].notna().any() else "avg"
    caption = ("▲ / ▼: KL closer to / further from the full cache than the budget's baseline (Holm-adjusted "
               "sign-flip p < 0.05, interval excluding 0); unmarked: tied. Score: "
               + ("informative tasks" if score == "avg_informative" else "all tasks")) if marked else None
    table = Table(title=title, caption=caption)
    table.add_column("method")
    for budget in budgets:
        table.add_column(f"B={budget}", justify="right")
    for method in dict.fromkeys(board["method"]):
        rows = board[board["method"] == method]
        if method == REFERENCE:
            cell = f"0 ({rows[score].iloc[0]:.2f}, ref)"
            table.add_row(method, *([cell] * len(budgets)))
            continue
        cells = []
        for budget in budgets:
            match = rows[rows["budget"] == budget]
            if match.empty:
                cells.append("–")
                continue
            row = match.iloc[0]
            mark = {"closer": "▲", "further": "▼"}.get(row["kl_verdict"], "") if marked else ""
            cells.append(f"{mark}{row['kl']:.3g} ({row[score]:.2f})")
        table.add_row(method, *cells)
    return table
