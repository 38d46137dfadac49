"""ROUGE-L for the LongBench summarisation datasets: the official scorer's, re-implemented, and Google's.

ROUGE-L is re-implemented (same tokenization, tie-breaks and formula as `rouge==1.0.1`) because the
package's recursive LCS crashes on long texts, which the official code silently scores as 0: where the
official scorer gives 0 (a sentence pair whose LCS trace passes Python's recursion limit, roughly 500+
words each), we give the true ROUGE-L. Memory and time stay bounded: texts whose LCS tables would
together exceed `MAX_LCS_CELLS` cells (e.g. two texts of about 5,800 words each), or that split into
more than `MAX_SENTENCE_PAIRS` sentence pairs, score 0. `rouge="rouge-score"` swaps it for Google's
`rouge-score` implementation (ROUGE-L F1, Porter stemmer, as HELM scores summaries), for comparison
with papers that use it; parity stays the default.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import numpy as np

from ripplekv.defaults import ROUGE_CHOICES
from ripplekv.errors import UserError
from ripplekv.metrics.text import _jieba_cut

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


def check_rouge(rouge: str) -> str:
    if rouge not in ROUGE_CHOICES:
        raise UserError(f"--rouge must be one of {', '.join(ROUGE_CHOICES)}, got {rouge!r}")
    if rouge == "rouge-score" and importlib.util.find_spec("rouge_score") is None:
        raise UserError("--rouge rouge-score needs Google's rouge-score package: pip install 'ripplekv[rouge]' "
                        "(or leave --rouge at official)")
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
