"""`ripplekv report`: leaderboards, plots and a markdown summary from `predictions.jsonl` alone.

Every line of the predictions file carries what a table needs (task, category, method, budget, score,
fidelity, per-layer budgets), so a report can be re-rendered, or a run's numbers audited, without the
model. Scores follow LongBench: per task `round(100 * mean, 2)`, averages are over tasks.

The tables are computed in `analysis.tables`, drawn in `analysis.figures` and written out as text
in `analysis.summary`; this module loads the result lines and renders them all into the run folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from ripplekv.analysis import inference, stats
from ripplekv.analysis.allocation import allocation_headline, allocation_markdown, allocation_parts, method_specs
from ripplekv.analysis.figures import plot_kl_vs_budget, plot_layer_budgets, plot_score_vs_budget
from ripplekv.analysis.follow_up_best import holding_section
from ripplekv.analysis.follow_ups import (
    follow_up_markdown,
    follow_up_table,
    has_follow_ups,
    run_protocol,
)
from ripplekv.analysis.footprint import add_footprint
from ripplekv.analysis.forest import plot_forest
from ripplekv.analysis.headline import closest_pairs
from ripplekv.analysis.html_page import PAGE, write_run_page
from ripplekv.analysis.informative import counted_tasks, informative_tasks
from ripplekv.analysis.memory_axis import memory_markdown, memory_table, plot_memory_axis
from ripplekv.analysis.over_budget import flag as flag_over_budget
from ripplekv.analysis.over_budget import over_budget, thresholded
from ripplekv.analysis.plots import series_styles
from ripplekv.analysis.proportions import accuracy_tasks
from ripplekv.analysis.small_fits import RECORDS, small_fits
from ripplekv.analysis.small_fits import flag as flag_small_fits
from ripplekv.analysis.summary import summary_markdown
from ripplekv.analysis.tables import (
    BASELINES,
    _board_rows,
    add_uncertainty,
    leaderboard,
    leaderboard_wide,
    length_table,
    measure_samples,
    task_scores,
)
from ripplekv.analysis.time_spent import samples_timed, time_markdown, time_table
from ripplekv.errors import UserError
from ripplekv.metrics.rouge import check_rouge
from ripplekv.metrics.scoring import metric_label, score_sample
from ripplekv.runs.files import CONFIG, PREDICTIONS, REFERENCE, is_ceiling, run_ceilings, without_torn_sample
from ripplekv.runs.jsonl import read_jsonl
from ripplekv.runs.safeio import write_csv, write_text

FLOAT_FORMAT = "%.6g"
PRIMARY_BASELINE = "primary_baseline"  # config.json: the label a run declares its primary comparisons against


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
    return without_infeasible(frame)


def without_infeasible(frame: pd.DataFrame) -> pd.DataFrame:
    """The lines with numbers; the variants whose bytes did not fit their budget (`infeasible`, no numbers) go to
    `frame.attrs["infeasible"]`, for the memory-axis table to list, never to rank."""
    if "infeasible" not in frame.columns:
        return frame
    refused = frame["infeasible"].notna()
    kept = frame.loc[~refused].drop(columns="infeasible").reset_index(drop=True)
    kept.attrs["infeasible"] = frame.loc[refused].reset_index(drop=True)
    return kept


def ceilings_of(run_dir: str | Path, frame: pd.DataFrame) -> frozenset[str]:
    """The run's labels that know the answer, as its config.json records them (by name for older runs)."""
    try:
        config = json.loads((Path(run_dir) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if config is not None and not isinstance(config, dict):
        raise UserError(f"{Path(run_dir) / CONFIG} is not a JSON object; use a run folder written by `ripplekv eval`")
    recorded = run_ceilings(config)
    return recorded if recorded is not None else frozenset(m for m in frame["method"].unique() if is_ceiling(m))


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


# What `render` writes (listed at the end of `ripplekv eval` and `ripplekv report`; lengths.csv only when
# samples carry a length).
FIGURES = ("score_vs_budget.png", "kl_vs_budget.png", "layer_budgets.png", "kl_forest.png", "score_forest.png")
MEMORY_FIGURE = "memory_axis.png"  # drawn only when the run has a quantized variant


def plots_wanted() -> bool:
    """Whether eval's closing report draws its figures: RIPPLEKV_PLOTS=0 leaves them out (the tables and
    summary.md are the same). Drawing is ~95% of a small run's report (~2 s of CPU): the test suite runs about
    a hundred evals whose figures no test looks at. `ripplekv report` always draws."""
    return os.environ.get("RIPPLEKV_PLOTS", "1").strip().lower() not in ("0", "false", "no", "off")


def declared_baseline(run_dir: str | Path) -> str | None:
    """The baseline the run declares for its primary comparisons (config.json's `primary_baseline`), if any."""
    try:
        config = json.loads((Path(run_dir) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    declared = config.get(PRIMARY_BASELINE) if isinstance(config, dict) else None
    return str(declared) if declared else None


def primary_comparisons(board: pd.DataFrame) -> list[str]:
    """`method vs baseline at B` for each comparison the leaderboard makes (what report.json records)."""
    rows = board[board["versus"].notna() & (board["versus"] != board["method"])]
    return [f"{m} vs {v} at B={int(b)}" for m, v, b in zip(rows["method"], rows["versus"], rows["budget"])]


def render(run_dir: str | Path, rouge: str = "official", resamples: int = stats.RESAMPLES,
           seed: int = stats.SEED, plots: bool = True, html: bool = True, notes: dict | None = None,
           fits: dict | None = None) -> dict[str, pd.DataFrame]:
    """Write scores.csv, informative.csv, leaderboard.csv, headline.csv, leaderboard_wide.csv, ranks.csv,
    lengths.csv (when samples have a prompt length), allocation_only.csv and .md (when several methods share
    the uniform baseline's scorer), follow_ups.csv and .md (a multi-question run: `analysis.follow_ups`), the plots, summary.md and report.json (the settings) into `run_dir`; with
    the run's timings.csv, where the time went (`analysis.time_spent`) closes summary.md and is returned as
    "time". Without `plots`, FIGURES are not drawn and any left from an earlier render are removed (they would
    no longer match the tables). With `html`, index.html (`analysis.html_page`; `notes`: what each method is) is
    written last, from those files."""
    run_dir = Path(run_dir)
    check_rouge(rouge)
    if resamples < 1:
        raise UserError(f"--resamples must be a positive number, got {resamples}")
    loaded = load_predictions(run_dir)
    frame = rescore_rouge(loaded, rouge)
    informative = informative_tasks(frame, rouge)
    counted = counted_tasks(informative)
    scores = task_scores(frame, informative)
    ceilings = ceilings_of(run_dir, frame)
    specs = method_specs(run_dir)
    over, thresholds = over_budget(frame), thresholded(specs)
    small = small_fits(fits or {})  # rows read from a smoke-size learned fit
    # Never ranked: answer-aware ceilings, variants over or at no budget, smoke-size fits
    unranked = ceilings | over | thresholds | set(small)
    declared = declared_baseline(run_dir)
    board, ranks = add_uncertainty(frame, leaderboard(scores, unranked, counted), resamples, seed, unranked, counted,
                                   declared)
    board = flag_small_fits(flag_over_budget(board, over, thresholds), small)
    headline = run_headline(frame, board, unranked, counted, seed)
    wide = leaderboard_wide(scores, board)
    lengths = length_table(frame, board)
    parts = allocation_parts(frame[~frame["method"].isin(over | thresholds)], specs, ceilings, counted, seed, declared)
    allocation = None if parts is None else parts[0]
    if parts is not None:
        headline = pd.concat([headline, allocation_headline(parts, seed)], ignore_index=True)
    memory = memory_table(frame, board, specs, loaded.attrs.get("infeasible"))
    follow = follow_up_table(frame) if has_follow_ups(frame) else None  # the multi-question protocols
    spent = time_table(run_dir)
    board = add_footprint(board)  # the critical KV footprint (`analysis.footprint`), on every row of a method
    settings = {"rouge": rouge, "resamples": resamples, "seed": seed, "confidence": inference.CONFIDENCE,
                "interval": "stratified t (Welch-Satterthwaite); accuracies: Wilson, paired differences Tango's "
                "score interval, MOVER over tasks; every interval cut to its scale",
                "accuracy_tasks": sorted(accuracy_tasks(frame)), "test": "stratified paired sign-flip",
                "permutations": inference.PERMUTATIONS, "refined_permutations": inference.REFINED_PERMUTATIONS,
                "exact_up_to": inference.EXACT_LIMIT, "meaningful_effect": inference.MEANINGFUL,
                "power": inference.POWER, "samples_per_row": int(board["n"].max()),
                "adjustment": "Holm, per table and measure", "informative_tasks": counted,
                "baseline": declared or "first of " + ", ".join(BASELINES) + " present at each budget",
                "primary_comparisons": primary_comparisons(board), RECORDS: fits or {}}
    try:
        write_csv(run_dir / "scores.csv", scores, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "informative.csv", informative, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard.csv", board, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "headline.csv", headline, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard_wide.csv", wide, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "ranks.csv", ranks, float_format=FLOAT_FORMAT)
        if lengths is not None:
            write_csv(run_dir / "lengths.csv", lengths, float_format=FLOAT_FORMAT)
        if allocation is not None:  # the allocation-only table (`analysis.allocation`)
            write_csv(run_dir / "allocation_only.csv", allocation, float_format=FLOAT_FORMAT)
            write_text(run_dir / "allocation_only.md", allocation_markdown(allocation))
        if memory is not None:  # the memory axis (`analysis.memory_axis`)
            write_csv(run_dir / "memory_axis.csv", memory, float_format=FLOAT_FORMAT)
            write_text(run_dir / "memory_axis.md", memory_markdown(memory))
        follow_text = None if follow is None else (follow_up_markdown(follow, run_protocol(run_dir))
                                                   + holding_section(frame, run_protocol(run_dir)))
        for name, written in (("follow_ups.csv", follow), ("follow_ups.md", follow_text)):
            if written is None:
                (run_dir / name).unlink(missing_ok=True)
        if follow is not None:
            write_csv(run_dir / "follow_ups.csv", follow, float_format=FLOAT_FORMAT)
            write_text(run_dir / "follow_ups.md", follow_text)
        write_text(run_dir / "report.json", json.dumps(settings, indent=2) + "\n")
        styles = series_styles(m for m in dict.fromkeys(frame["method"]) if m != REFERENCE)  # the run's order
        # A run of the full cache alone (a task screen) has no compressed variant to draw
        compressed = bool((frame["method"] != REFERENCE).any())
        if plots and compressed:
            plot_score_vs_budget(board, run_dir / "score_vs_budget.png", ceilings, styles)
            plot_kl_vs_budget(board, run_dir / "kl_vs_budget.png", ceilings, styles)
            plot_layer_budgets(frame, run_dir / "layer_budgets.png")
            plot_forest(board, run_dir / "kl_forest.png", "kl", unranked, styles)
            plot_forest(board, run_dir / "score_forest.png", "score", unranked, styles)
            if memory is not None:
                plot_memory_axis(memory, run_dir / MEMORY_FIGURE, styles)
        else:
            for name in FIGURES:
                (run_dir / name).unlink(missing_ok=True)
        if memory is None or not plots:
            (run_dir / MEMORY_FIGURE).unlink(missing_ok=True)
        text = summary_markdown(frame, board, wide, run_dir, ranks, lengths, settings, ceilings, headline, informative)
        if memory is not None:
            text += "\n" + memory_markdown(memory)
        if follow_text is not None:
            text += "\n" + follow_text
        if spent is not None:
            text += "\n" + time_markdown(spent, samples_timed(run_dir))
        write_text(run_dir / "summary.md", text)
        if html:
            write_run_page(run_dir, notes=notes, lines=loaded)
        else:
            (run_dir / PAGE).unlink(missing_ok=True)
    except OSError as err:
        raise UserError(f"cannot write the report into {run_dir}: {err.strerror or err}") from None
    return {"scores": scores, "leaderboard": board, "leaderboard_wide": wide, "ranks": ranks, "lengths": lengths,
            "allocation": allocation, "memory": memory, "follow_ups": follow, "time": spent, "headline": headline, "informative": informative}


def run_headline(frame: pd.DataFrame, board: pd.DataFrame, ceilings, counted: list[str], seed: int) -> pd.DataFrame:
    """headline.csv: per budget, the real method closest to the full cache and the runner-up (`analysis.headline`)."""
    keyed = frame.assign(key=_board_rows(board, frame))
    kl, _, _, score = measure_samples(keyed, list(range(len(board))), counted)
    real = (board["method"] != REFERENCE) & ~board["method"].map(lambda m: is_ceiling(m, ceilings)).astype(bool)
    if "fewer_samples" in board:
        real &= ~board["fewer_samples"].astype(bool)
    return closest_pairs(board.assign(score=board["avg_informative"]), real, kl, score, "all methods", seed)
