"""Fitting an offline sample to its target length: the per-call `_Builder` and its small helpers.

`_Builder` holds one build's seeded generators and record layout and grows each sample's filler
until the full prompt (template and chat template included, counted with the caller's tokenizer) is
as close to the target length as whole units allow, at about one tokenization per sample. The task
builders in `tasks.offline` all go through it.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from random import Random

from ripplekv.errors import UserError
from ripplekv.tasks import prompts
from ripplekv.tasks.offline_sources import _rng

DEFAULT_SIZES = {"eval": 20, "calibration": 8}
# A first guess within 2% of the target is kept; otherwise whole units (a passage, a sentence, a
# line) are added or removed towards the target. Tests hold every prompt to 5%.
TOLERANCE = 0.02
MARGIN = 0.05  # what the suite promises; a sample built further off is said (`offline.build_samples`)


# ---------------------------------------------------------------- building samples


class _Builder:
    """Per-call helpers: seeded generators, record layout, exact prompt length, length fitting."""

    def __init__(self, task, tokenizer, split: str, target: int, seed: int):
        self.task, self.tokenizer, self.split, self.target, self.seed = task, tokenizer, split, target, seed
        self.ratio = 0.23  # tokens per character; refit on every exact count, carried to the next sample
        self.lengths: list[int] = []  # each fitted sample's prompt length (units' counts added: within a token or two)

    def measure(self, record: dict) -> int:
        return prompts.prompt_length(self.task, record, self.tokenizer)

    def rng(self, *parts) -> Random:
        return _rng(self.seed, self.task.name, self.split, *parts)

    def depth(self, i: int) -> float:
        """Depth of sample i in [0, 1]: evenly spread over one default-sized split, then repeating."""
        period = DEFAULT_SIZES[self.split]
        return (i % period) / (period - 1)

    def record(self, i: int, context: str, question: str, answers) -> dict:
        tag = f"s{self.seed}-" if self.seed else ""
        return {
            "input": question,
            "context": context,
            "answers": list(answers),
            "length": len(context.split()),
            "dataset": self.task.name,
            "language": "en",
            "all_classes": None,
            "_id": f"offline-{self.task.name}-{tag}{self.split}-{i:04d}",
        }

    def count(self, texts: list[str]) -> list[int]:
        """Token counts of a few text pieces, in one batched tokenizer call."""
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids] if texts else []

    def fit(self, compose, units: list[str], k_min: int = 0) -> dict:
        """compose(k) builds the record with the first k filler units; return the one whose prompt
        is closest to the target length.

        1. Guess k from characters: L(k) ~ L(k_min) + ratio * chars(units k_min..k), with the
           tokens-per-character ratio learnt from the previous sample's exact count.
        2. Count that prompt exactly (one full tokenization).
        3. If it is off by more than 2%, count only the units that would enter or leave and step
           k unit by unit towards the target; their token counts add up to the new length within
           a token or two per unit (units are tokenized on their own).
        """
        prefix = list(accumulate(map(len, units), initial=0))
        k_min = min(k_min, len(units))
        record = compose(k_min)
        length = base = self.measure(record)
        k = max(k_min, _closest(prefix, prefix[k_min] + (self.target - base) / self.ratio))
        if k > k_min:
            record = compose(k)
            length = self.measure(record)
            self.ratio = max(0.05, (length - base) / (prefix[k] - prefix[k_min]))
        gap = self.target - length
        if abs(gap) <= TOLERANCE * self.target:
            self.lengths.append(length)
            return record
        # the units that would enter (gap > 0) or leave (gap < 0), nearest first, enough to cover the gap
        span = range(k, len(units)) if gap > 0 else range(k - 1, k_min - 1, -1)
        moving, chars = [], 0
        for j in span:
            moving.append(j)
            chars += len(units[j])
            if chars * self.ratio >= 1.5 * abs(gap) + 50:
                break
        best_k, best_length = k, length
        for j, tokens in zip(moving, self.count([units[j] for j in moving])):
            length += tokens if gap > 0 else -tokens
            if abs(length - self.target) >= abs(best_length - self.target):
                break
            best_k, best_length = (j + 1 if gap > 0 else j), length
        self.lengths.append(best_length)
        return record if best_k == k else compose(best_k)


def _closest(prefix: list[int], want: float) -> int:
    i = bisect.bisect_left(prefix, want)
    candidates = [j for j in (i - 1, i) if 0 <= j < len(prefix)]
    return min(candidates, key=lambda j: (abs(prefix[j] - want), j))


def _enough(chars: int, target: int) -> bool:
    """Whether gathered filler surely covers the target (English prose and code: 4-5 chars/token)."""
    return chars >= 6 * target


def _take(items: list, n: int, what: str, split: str) -> list:
    if n > len(items):
        raise UserError(f"offline {what} has only {len(items)} {split} samples; ask for at most that many")
    return items[:n]
