"""The per-answer LongBench metrics other than ROUGE-L: QA token F1, classification, passage retrieval,
counting, code similarity and string match.

Each is `fn(prediction, ground_truth, **kwargs) -> float` in [0, 1] with the official scorer's numbers
(LongBench v1 `metrics.py`), quirks included; `metrics.scoring` picks one per dataset and takes the
best value over the gold answers.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Sequence

from ripplekv.errors import UserError
from ripplekv.metrics.text import _jieba_cut, normalize_answer, normalize_zh_answer

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


_CHOICE_PATTERNS = (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])"))


def extract_choice(response: str) -> str | None:
    """LongBench v2's answer extraction (`pred.py`): `*` removed, then "The correct answer is (X)", else
    "The correct answer is X"; None when neither is there."""
    response = response.strip().replace("*", "")
    for pattern in _CHOICE_PATTERNS:
        match = pattern.search(response)
        if match:
            return match.group(1)
    return None


def choice_accuracy_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1 when the extracted choice is the gold letter (LongBench v2's `judge`), else 0."""
    return float(extract_choice(prediction) == ground_truth)
