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

from ripplekv.analysis import stats
from ripplekv.analysis.allocation import allocation_markdown, allocation_table, method_specs
from ripplekv.analysis.figures import plot_kl_vs_budget, plot_layer_budgets, plot_score_vs_budget
from ripplekv.analysis.forest import plot_forest
from ripplekv.analysis.summary import summary_markdown
from ripplekv.analysis.tables import add_uncertainty, leaderboard, leaderboard_wide, length_table, task_scores
from ripplekv.analysis.time_spent import samples_timed, time_markdown, time_table
from ripplekv.errors import UserError
from ripplekv.metrics.rouge import check_rouge
from ripplekv.metrics.scoring import metric_label, score_sample
from ripplekv.runs.files import CONFIG, PREDICTIONS, is_ceiling, run_ceilings, without_torn_sample
from ripplekv.runs.jsonl import read_jsonl
from ripplekv.runs.safeio import write_csv, write_text

FLOAT_FORMAT = "%.6g"


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


def plots_wanted() -> bool:
    """Whether eval's closing report draws its figures: RIPPLEKV_PLOTS=0 leaves them out (the tables and
    summary.md are the same). Drawing is ~95% of a small run's report (~2 s of CPU): the test suite runs about
    a hundred evals whose figures no test looks at. `ripplekv report` always draws."""
    return os.environ.get("RIPPLEKV_PLOTS", "1").strip().lower() not in ("0", "false", "no", "off")


def render(run_dir: str | Path, rouge: str = "official", resamples: int = stats.RESAMPLES,
           seed: int = stats.SEED, plots: bool = True) -> dict[str, pd.DataFrame]:
    """Write scores.csv, leaderboard.csv, leaderboard_wide.csv, ranks.csv, lengths.csv (when samples have
    a length), allocation_only.csv and .md (when several methods share the uniform baseline's scorer), the plots,
    summary.md and report.json (the settings) into `run_dir`; with the run's timings.csv, where the time went
    (`analysis.time_spent`) closes summary.md and is returned as "time". Without `plots`, FIGURES are not
    drawn and any left from an earlier render are removed (they would no longer match the tables)."""
    run_dir = Path(run_dir)
    check_rouge(rouge)
    if resamples < 1:
        raise UserError(f"--resamples must be a positive number, got {resamples}")
    frame = rescore_rouge(load_predictions(run_dir), rouge)
    scores = task_scores(frame)
    ceilings = ceilings_of(run_dir, frame)
    board, ranks = add_uncertainty(frame, leaderboard(scores, ceilings), resamples, seed, ceilings)
    wide = leaderboard_wide(scores, board)
    lengths = length_table(frame, board)
    allocation = allocation_table(frame, method_specs(run_dir), resamples, seed, ceilings)
    spent = time_table(run_dir)
    settings = {"rouge": rouge, "resamples": resamples, "seed": seed, "confidence": stats.CONFIDENCE}
    try:
        write_csv(run_dir / "scores.csv", scores, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard.csv", board, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "leaderboard_wide.csv", wide, float_format=FLOAT_FORMAT)
        write_csv(run_dir / "ranks.csv", ranks, float_format=FLOAT_FORMAT)
        if lengths is not None:
            write_csv(run_dir / "lengths.csv", lengths, float_format=FLOAT_FORMAT)
        if allocation is not None:  # the allocation-only table (`analysis.allocation`)
            write_csv(run_dir / "allocation_only.csv", allocation, float_format=FLOAT_FORMAT)
            write_text(run_dir / "allocation_only.md", allocation_markdown(allocation))
        write_text(run_dir / "report.json", json.dumps(settings, indent=2) + "\n")
        if plots:
            plot_score_vs_budget(board, run_dir / "score_vs_budget.png", ceilings)
            plot_kl_vs_budget(board, run_dir / "kl_vs_budget.png", ceilings)
            plot_layer_budgets(frame, run_dir / "layer_budgets.png")
            plot_forest(board, run_dir / "kl_forest.png", "kl", ceilings)
            plot_forest(board, run_dir / "score_forest.png", "score", ceilings)
        else:
            for name in FIGURES:
                (run_dir / name).unlink(missing_ok=True)
        text = summary_markdown(frame, board, wide, run_dir, ranks, lengths, settings, ceilings)
        if spent is not None:
            text += "\n" + time_markdown(spent, samples_timed(run_dir))
        write_text(run_dir / "summary.md", text)
    except OSError as err:
        raise UserError(f"cannot write the report into {run_dir}: {err.strerror or err}") from None
    return {"scores": scores, "leaderboard": board, "leaderboard_wide": wide, "ranks": ranks, "lengths": lengths,
            "allocation": allocation, "time": spent}
