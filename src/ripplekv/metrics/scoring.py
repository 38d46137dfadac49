"""LongBench scoring with the official scorer's numbers (LongBench v1 `metrics.py` + `eval.py`).

Each metric is `fn(prediction, ground_truth, **kwargs) -> float` in [0, 1]; a sample scores the
best metric value over its gold answers, and a dataset scores `round(100 * mean, 2)`, as the
official `eval.py` does. ROUGE-L is re-implemented (same tokenization, tie-breaks and formula as
`rouge==1.0.1`) because the package's recursive LCS crashes on long texts, which the official code
silently scores as 0: where the official scorer gives 0 (a sentence pair whose LCS trace passes
Python's recursion limit, roughly 500+ words each), we give the true ROUGE-L. Memory and time stay
bounded: texts whose LCS tables would together exceed `MAX_LCS_CELLS` cells (e.g. two texts of about
5,800 words each), or that split into more than `MAX_SENTENCE_PAIRS` sentence pairs, score 0.

`rouge="rouge-score"` swaps the official ROUGE-L for Google's `rouge-score` implementation (ROUGE-L F1,
Porter stemmer, as HELM scores summaries), for comparison with papers that use it; parity stays the
default.

`load_predictions` / `score_predictions` score a predictions file of JSON lines
`{dataset, pred, answers, all_classes[, length]}`, so outputs of other tools can be rescored.
"""

from __future__ import annotations

import json
import math
import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from ripplekv.errors import UserError

# --------------------------------------------------------------------------- text normalisation

_EN_PUNCT = set(string.punctuation)
_ZH_PUNCT = _EN_PUNCT | set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lower case, drop English and Chinese punctuation and all whitespace."""
    return "".join(ch for ch in text.lower() if ch not in _ZH_PUNCT and not ch.isspace())


def _jieba_cut(text: str) -> list[str]:
    """Chinese word segmentation as the official scorer does it (precise mode); jieba is loaded lazily
    because its dictionary takes a second to build and only Chinese datasets need it. Short texts are
    cached: a prediction is cut once, not once per gold answer."""
    return list(_cut_short(text)) if len(text) <= 2000 else _cut(text)


@lru_cache(maxsize=1024)
def _cut_short(text: str) -> tuple[str, ...]:
    return tuple(_cut(text))


def _cut(text: str) -> list[str]:
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


# --------------------------------------------------------------------------- QA F1


def _token_f1(prediction: list[str], ground_truth: list[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 after SQuAD normalisation (English QA datasets)."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 over jieba words, each normalised, empty ones dropped (multifieldqa_zh)."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_cut(text)) if w]

    return _token_f1(words(prediction), words(ground_truth))


# --------------------------------------------------------------------------- ROUGE-L (summary level)


def _rouge_sentences(text: str) -> list[list[str]]:
    """Sentences as rouge 1.0.1 sees them: split on every '.', drop empty pieces, collapse whitespace,
    then split words on single spaces (a whitespace-only piece thus becomes the one word '')."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


# Bounds on ROUGE-L's work: LCS table cells over all sentence pairs (2**25 int32 = 128 MiB for one
# pair of 5.8k-word sentences, about 0.3 s), and sentence pairs (each costs a few numpy calls).
MAX_LCS_CELLS = 2**25
MAX_SENTENCE_PAIRS = 2**16


def _lcs_words(ref: list[str], hyp: list[str]) -> list[str]:
    """Reference words on one longest common subsequence of `ref` and `hyp`.

    The path is traced back with the same tie-break as rouge 1.0.1's recursive `_recon` (step up
    only when the cell above is strictly larger), because which LCS is picked changes the word set
    it contributes. Iterative and table-driven, so any length works.
    """
    vocab: dict[str, int] = {}
    x = np.array([vocab.setdefault(w, len(vocab)) for w in ref], dtype=np.int64)
    y = np.array([vocab.setdefault(w, len(vocab)) for w in hyp], dtype=np.int64)
    n, m = len(x), len(y)
    table = np.zeros((n + 1, m + 1), dtype=np.int32)
    for i in range(1, n + 1):
        # T[i][j] = max(T[i-1][j-1] + match, T[i-1][j], T[i][j-1]): a running max along the row.
        candidate = np.maximum(table[i - 1, 1:], table[i - 1, :-1] + (y == x[i - 1]))
        table[i, 1:] = np.maximum.accumulate(candidate)
    words: list[str] = []
    i, j = n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.append(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1, j] > table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_f(hypothesis: str, reference: str) -> float:
    """Summary-level ROUGE-L F as `rouge.Rouge().get_scores(hyp, ref)['rouge-l']['f']` computes it.

    Like the package (default `exclusive=True`) it counts distinct words: the union of LCS words over
    all reference x hypothesis sentence pairs, over the distinct words of each side.
    An empty side (no sentence at all) makes the package raise, which the official scorer turns
    into 0, so that is 0 here too.
    """
    hyp = _rouge_sentences(hypothesis)
    ref = _rouge_sentences(reference)
    if not hyp or not ref:
        return 0.0
    cells = sum(len(r) + 1 for r in ref) * sum(len(h) + 1 for h in hyp)
    if cells > MAX_LCS_CELLS or len(ref) * len(hyp) > MAX_SENTENCE_PAIRS:
        return 0.0  # beyond our bounds on memory and time (see the module docstring)
    union: set[str] = set()
    hyp_sets = [set(h) for h in hyp]
    for ref_words in ref:
        ref_set = set(ref_words)
        for hyp_words, hyp_set in zip(hyp, hyp_sets):
            if not (ref_set & hyp_set) <= union:  # an LCS holds only shared words: else it adds nothing
                union.update(_lcs_words(ref_words, hyp_words))
    recall = len(union) / len({w for s in ref for w in s})
    precision = len(union) / len({w for s in hyp for w in s})
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F on the raw text, no lower-casing (English summarisation datasets)."""
    return rouge_l_f(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F over jieba words joined by spaces (Chinese summarisation datasets)."""
    return rouge_l_f(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


ROUGE_CHOICES = ("official", "rouge-score")


def check_rouge(rouge: str) -> str:
    if rouge not in ROUGE_CHOICES:
        raise UserError(f"--rouge must be one of {', '.join(ROUGE_CHOICES)}, got {rouge!r}")
    return rouge


class _SplitTokenizer:
    """rouge-score's default tokenizer keeps only [a-z0-9]; Chinese text arrives as jieba words
    joined by spaces, so split on whitespace instead."""

    def tokenize(self, text: str) -> list[str]:
        return text.lower().split()


@lru_cache(maxsize=2)
def _google_scorer(chinese: bool):
    from rouge_score import rouge_scorer

    if chinese:
        return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_SplitTokenizer())
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def google_rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F1 by Google's `rouge-score` (lower-cased, alphanumeric tokens, Porter stemmer)."""
    return _google_scorer(False).score(ground_truth, prediction)["rougeL"].fmeasure


def google_rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F1 by `rouge-score` over jieba words (Chinese summarisation datasets)."""
    words = lambda text: " ".join(_jieba_cut(text))  # noqa: E731
    return _google_scorer(True).score(words(ground_truth), words(prediction))["rougeL"].fmeasure


# --------------------------------------------------------------------------- classification, ids, counts, code


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/k when the gold class is among the k class names found in the prediction.

    Keeps the official quirk: names that are substrings of the gold class are dropped while the
    list is being walked, so the element right after each dropped one is never checked.
    """
    all_classes = kwargs.get("all_classes")
    if not all_classes:
        raise UserError("classification needs 'all_classes' (the list of class names) for each sample")
    found = [name for name in all_classes if name in prediction]
    k = 0
    while k < len(found):
        if found[k] in ground_truth and found[k] != ground_truth:
            found.remove(found[k])  # removes the first equal entry, and the index does not advance...
        k += 1  # ...so the next entry is skipped, exactly as `for x in lst: lst.remove(x)` does
    return 1.0 / len(found) if ground_truth in found else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    """Share of the numbers in the prediction that equal the target (0 when there are none)."""
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def _retrieval(prediction: str, ground_truth: str, pattern: str) -> float:
    """Share of the numbers in the prediction that equal the paragraph id of the gold answer."""
    ids = re.findall(pattern, ground_truth)
    if not ids:
        raise UserError(f"retrieval answer {ground_truth!r} has no paragraph id matching {pattern!r}")
    return _share_equal(re.findall(r"\d+", prediction), ids[0])


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """English passage retrieval: gold answers look like 'Paragraph 12'."""
    return _retrieval(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Chinese passage retrieval: gold answers look like '段落12'."""
    return _retrieval(prediction, ground_truth, r"段落(\d+)")


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction that equal the gold count."""
    return _share_equal(re.findall(r"\d+", prediction), str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """fuzzywuzzy ratio between the gold line and the first predicted line that is not a comment
    or a code fence (no '`', '#' or '//'); empty when every line is one."""
    with warnings.catch_warnings():  # it warns once that python-Levenshtein is absent
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz
    first = next(
        (line for line in prediction.lstrip("\n").split("\n") if not any(t in line for t in ("`", "#", "//"))),
        "",
    )
    return fuzz.ratio(first, ground_truth) / 100


def string_match_score(prediction: str, ground_truth: str | Sequence[str], **kwargs) -> float:
    """Share of the gold strings that occur verbatim in the prediction (needle-in-a-haystack).

    Takes the whole answer list at once: with several needles each one found earns its share,
    with one needle the score is 0 or 1.
    """
    golds = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    if not golds:
        return 0.0
    return sum(gold in prediction for gold in golds) / len(golds)


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
}

# Replacements under `rouge="rouge-score"`.
_GOOGLE_ROUGE = {"rouge": google_rouge_score, "rouge_zh": google_rouge_zh_score}

# Metrics that score the whole answer list at once instead of the best single answer.
_WHOLE_LIST_METRICS = {"string_match"}

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


def load_predictions(path: Path) -> list[dict]:
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
        with path.open(encoding="utf-8") as fh:
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
    is followed by one row per non-empty length bucket, named `<dataset>@0-4k`, `@4-8k`, `@8k+`.
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
        by_dataset.setdefault((rec["dataset"], *variant.values()), []).append((value, rec["length"]))

    dataset_rows = []
    for (dataset, *variant), items in by_dataset.items():
        variant = dict(zip(variant_cols, variant))
        metric = metric_label(dataset, rouge)
        dataset_rows.append({"dataset": dataset, **variant, "n": len(items), "score": aggregate([v for v, _ in items]),
                             "metric": metric})
        if is_longbench_e(dataset):
            buckets: dict[str, list[float]] = {name: [] for name in LENGTH_BUCKETS}
            for value, length in items:
                buckets[length_bucket(length)].append(value)
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
