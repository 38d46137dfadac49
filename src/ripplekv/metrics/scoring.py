"""LongBench scoring with the official scorer's numbers (LongBench v1 `metrics.py` + `eval.py`).

Each metric (`metrics.answers`, `metrics.rouge`) is `fn(prediction, ground_truth, **kwargs) -> float`
in [0, 1]; a sample scores the best metric value over its gold answers, and a dataset scores
`round(100 * mean, 2)`, as the official `eval.py` does. This module holds the metric table, the
sample / dataset / length-bucket scoring and the predictions files.

`read_prediction_file` / `score_predictions` score a predictions file of JSON lines
`{dataset, pred, answers, all_classes[, length]}`, so outputs of other tools can be rescored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.metrics.answers import (
    choice_accuracy_score,
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    string_match_score,
)
from ripplekv.metrics.rouge import (
    check_rouge,
    google_rouge_score,
    google_rouge_zh_score,
    rouge_score,
    rouge_zh_score,
)
from ripplekv.metrics.ruler import string_match_all_score, string_match_part_score

# --------------------------------------------------------------------------- tables

METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
    "string_match": string_match_score,
    "string_match_all": string_match_all_score,  # RULER's, from its package
    "string_match_part": string_match_part_score,
    "choice_accuracy": choice_accuracy_score,  # LongBench v2
}

# Replacements under `rouge="rouge-score"`.
_GOOGLE_ROUGE = {"rouge": google_rouge_score, "rouge_zh": google_rouge_zh_score}

# Metrics that score the whole answer list at once instead of the best single answer.
_WHOLE_LIST_METRICS = {"string_match", "string_match_all", "string_match_part"}

LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def task_of(dataset):
    """The registry's task for a task or a dataset name (a UserError listing the known names)."""
    from ripplekv.tasks.registry import Task, task_named

    return dataset if isinstance(dataset, Task) else task_named(dataset)


def metric_for(dataset) -> str:
    """The metric name for a task or a dataset name (the task registry's `metric`)."""
    return task_of(dataset).metric


def is_longbench_e(dataset) -> bool:
    """A LongBench-E dataset (`<name>_e`), whose samples fall into the 0-4k / 4-8k / 8k+ buckets (an unknown
    name is not one)."""
    try:
        return task_of(dataset).suite == "longbench-e"
    except UserError:
        return False


def score_sample(
    dataset,
    prediction: str,
    answers: Sequence[str],
    all_classes: Sequence[str] | None = None,
    rouge: str = "official",
) -> float:
    """One sample's score in [0, 1]: the best metric value over the gold answers (0 with none), after the
    official first-line cut where the task asks for it (trec, triviaqa, samsum, lsht). `dataset` is a task
    or a dataset name. `rouge` picks the ROUGE-L implementation for the ROUGE datasets (`official` or
    `rouge-score`)."""
    task = task_of(dataset)
    metric = task.metric
    if task.first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRICS[metric]
    if check_rouge(rouge) == "rouge-score" and metric in _GOOGLE_ROUGE:
        fn = _GOOGLE_ROUGE[metric]
    if metric in _WHOLE_LIST_METRICS:
        return float(fn(prediction, list(answers)))
    best = 0.0
    for answer in answers:
        best = max(best, fn(prediction, answer, all_classes=all_classes))
    return float(best)


def aggregate(scores: Sequence[float]) -> float:
    """Per-sample scores in [0, 1] -> dataset score, `round(100 * mean, 2)`; NaN when empty
    (the official scorer's value for an empty length bucket)."""
    if len(scores) == 0:
        return float("nan")
    return round(100 * sum(scores) / len(scores), 2)


def score_dataset(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None,
    lengths: Sequence[float] | None = None,
) -> float:
    """Dataset score `round(100 * mean, 2)` as official `eval.py` gives it (one shared `all_classes`).
    `lengths` is accepted for a uniform call shape with `score_by_length` and not used."""
    if len(predictions) != len(answers):
        raise UserError(f"{dataset}: {len(predictions)} predictions but {len(answers)} answer lists")
    if not predictions:
        raise UserError(f"{dataset}: no predictions to score")
    return aggregate([score_sample(dataset, p, a, all_classes) for p, a in zip(predictions, answers)])


def length_bucket(length: float) -> str:
    """LongBench-E context-length bucket: under 4000, under 8000, else 8k+."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def score_by_length(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None,
    lengths: Sequence[float],
) -> dict[str, float]:
    """LongBench-E scores per length bucket, `{"0-4k": .., "4-8k": .., "8k+": ..}`; an empty bucket
    is NaN, as in the official scorer."""
    if not (len(predictions) == len(answers) == len(lengths)):
        raise UserError(f"{dataset}: predictions, answers and lengths differ in number")
    buckets: dict[str, list[float]] = {name: [] for name in LENGTH_BUCKETS}
    for pred, golds, length in zip(predictions, answers, lengths):
        buckets[length_bucket(length)].append(score_sample(dataset, pred, golds, all_classes))
    return {name: aggregate(scores) for name, scores in buckets.items()}


# --------------------------------------------------------------------------- prediction files


def read_prediction_file(path: Path) -> list[dict]:
    """Read and check a predictions file of JSON lines `{dataset, pred, answers, all_classes[, length]}`.

    ripplekv's own `predictions.jsonl` is read too: its `task` names the dataset, `prediction` is the
    prediction, and `method`/`budget` are kept so each variant is scored on its own.
    Blank lines are skipped. Each record gets `line`: its 0-based line number in the file. Problems
    are a `UserError` naming the file and the 1-based line number, as editors count.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"predictions file not found: {path}")
    records = []
    try:
        with path.open(encoding="utf-8-sig") as fh:
            lines = list(fh)
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; pass a JSON-lines predictions file") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    for index, text in enumerate(lines):
        if not text.strip():
            continue
        where = f"{path} line {index + 1}"
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(rec, dict):
            raise UserError(f"{where}: expected a JSON object")
        if rec.get("infeasible"):  # a variant over its memory budget: no prediction to score
            continue
        if "dataset" not in rec and "task" in rec and "prediction" in rec:  # ripplekv eval output
            rec = {**rec, "dataset": rec["task"], "pred": rec["prediction"]}
        dataset = rec.get("dataset")
        if not isinstance(dataset, str):
            raise UserError(f"{where}: 'dataset' missing or not a string")
        try:
            metric_for(dataset)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
        if not isinstance(rec.get("pred"), str):
            raise UserError(f"{where}: 'pred' missing or not a string")
        answers = rec.get("answers")
        if not isinstance(answers, list):
            raise UserError(f"{where}: 'answers' missing or not a list")
        if not answers:
            raise UserError(f"{where}: 'answers' is an empty list; a prediction needs at least one reference answer")
        if not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in answers):
            raise UserError(f"{where}: 'answers' must hold strings (or numbers), not null, lists or objects")
        all_classes = rec.get("all_classes")
        if all_classes is not None and not (isinstance(all_classes, list)
                                            and all(isinstance(c, str) for c in all_classes)):
            raise UserError(f"{where}: 'all_classes' must be a list of strings or null")
        length = rec.get("length")
        if is_longbench_e(dataset):
            if isinstance(length, bool) or not isinstance(length, (int, float)) or not math.isfinite(length):
                raise UserError(f"{where}: LongBench-E dataset {dataset} needs a numeric 'length'")
        records.append(
            {
                "line": index,
                "dataset": dataset,
                "pred": rec["pred"],
                "answers": [str(a) for a in answers],
                "all_classes": all_classes,
                "length": length,
                "method": rec.get("method"),
                "budget": rec.get("budget"),
                **{field: rec.get(field) for field in task_of(dataset).score_by},
            }
        )
    if not records:
        raise UserError(f"{path}: no predictions in the file")
    return records


def metric_label(dataset: str, rouge: str = "official") -> str:
    """The metric a dataset is scored with, naming the ROUGE implementation when it is not the official one."""
    metric = metric_for(dataset)
    return f"{metric}:rouge-score" if rouge == "rouge-score" and metric in _GOOGLE_ROUGE else metric


def score_predictions(records: list[dict], rouge: str = "official"):
    """Score loaded records -> (per-dataset table, per-sample table) as pandas DataFrames.

    Per-dataset rows `dataset,n,score,metric` in order of first appearance; each LongBench-E dataset
    is followed by one row per non-empty length bucket, named `<dataset>@0-4k`, `@4-8k`, `@8k+`, and a task
    with `score_by` fields (LongBench v2) by one row per value of each (`longbench_v2@easy`, `@hard`,
    `@short`, `@medium`, `@long`).
    `metric` names the metric (`rouge:rouge-score` under `rouge="rouge-score"`).
    Per-sample rows `line,dataset,score` with the score x100 rounded to 2 decimals.
    Records with a `method` (ripplekv's own output) are scored per (dataset, method, budget), and
    both tables get `method,budget` columns after `dataset`.
    """
    import pandas as pd

    variant_cols = ["method", "budget"] if any(rec.get("method") is not None for rec in records) else []
    sample_rows = []
    by_dataset: dict[tuple, list[tuple[float, float | None]]] = {}
    for rec in records:
        try:
            value = score_sample(rec["dataset"], rec["pred"], rec["answers"], rec["all_classes"], rouge)
        except UserError as err:
            raise UserError(f"line {rec['line'] + 1}: {err}") from None
        variant = {col: rec.get(col) for col in variant_cols}
        sample_rows.append({"line": rec["line"], "dataset": rec["dataset"], **variant, "score": round(100 * value, 2)})
        by_dataset.setdefault((rec["dataset"], *variant.values()), []).append((value, rec))

    dataset_rows = []
    for (dataset, *variant), items in by_dataset.items():
        variant = dict(zip(variant_cols, variant))
        metric = metric_label(dataset, rouge)
        dataset_rows.append({"dataset": dataset, **variant, "n": len(items), "score": aggregate([v for v, _ in items]),
                             "metric": metric})
        buckets: dict[str, list[float]] = {}
        if is_longbench_e(dataset):
            buckets = {name: [] for name in LENGTH_BUCKETS}
            for value, rec in items:
                buckets[length_bucket(rec["length"])].append(value)
        for field in task_of(dataset).score_by:  # LongBench v2: by difficulty, by length class
            for value, rec in items:
                if rec.get(field) is not None:
                    buckets.setdefault(str(rec[field]), []).append(value)
        for name, values in buckets.items():
            if values:
                dataset_rows.append({"dataset": f"{dataset}@{name}", **variant, "n": len(values),
                                     "score": aggregate(values), "metric": metric})
    datasets = pd.DataFrame(dataset_rows, columns=["dataset", *variant_cols, "n", "score", "metric"])
    samples = pd.DataFrame(sample_rows, columns=["line", "dataset", *variant_cols, "score"])
    if variant_cols:  # budgets stay integers next to the full cache's empty budget
        for table in (datasets, samples):
            table["budget"] = table["budget"].astype("Int64")
    return datasets, samples
