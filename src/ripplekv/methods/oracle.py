"""`oracle`: an answer-aware ceiling, not a deployable method.

Each KV head keeps the prompt entries that the full cache's own answer attends to most: the answer
tokens (after the question, in the context-only protocol) are fed through the full cache, and an entry's
score is the attention all answer queries pay it (softmax over every prompt entry and the tokens before
them), summed over answer tokens and averaged over the query heads of its KV head. Budgets are the
same exact ones as SnapKV's (uniform, L x H_kv x B), with no window forced (`oracle:window=32` keeps one).
It needs the answer (it declares the `reference_answer` signal; its recorder keeps the question and takes
the full cache's answer once the engine decoded it), so only `ripplekv eval` can run it; it bounds what a token selection could reach on that sample and budget, is
reported as a ceiling and is left out of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import FromSample, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_integers, register_scorer
from ripplekv.methods.signals.continuation import causal_attention_rows, probe_tokens
from ripplekv.methods.snapkv import WindowScorer

NO_ANSWER = "oracle needs the full cache's answer, so it runs only in `ripplekv eval` (after the full decode)"
REFERENCE_ANSWER = "reference_answer"  # the signal: the question read after the prompt, then the full answer


@dataclass(frozen=True)
class ReferenceAnswer:
    """The full cache's answer (`tokens`, None until decoded) after the question tokens it reads first."""

    question: tuple[int, ...]
    tokens: tuple[int, ...] | None = None


@register_recorder(REFERENCE_ANSWER)
class Answer(FromSample):
    """The sample's question at the prefill; the full cache's answer joins it once decoded (`answered`)."""

    def value(self, sample):
        return ReferenceAnswer(tuple(sample.question))

    @classmethod
    def answered(cls, recorded, tokens):
        return ReferenceAnswer(recorded.question, tuple(tokens))


def reference_answer(state) -> tuple[list[int], list[int]]:
    """(question tokens read first, the full cache's answer) as recorded for this prefill."""
    reference = state.signal(REFERENCE_ANSWER, None)
    if reference is None or reference.tokens is None:
        raise UserError(NO_ANSWER)
    return list(reference.question), list(reference.tokens)


def answer_attention(state, answer: Sequence[int] | None = None, prefix: Sequence[int] = ()) -> torch.Tensor:
    """Attention [L, H_kv, n] that `answer`, read after the prompt and `prefix`, pays each prompt entry
    (computed once per prefill and answer). Without `answer`: the full cache's, as recorded for the prefill
    (the `reference_answer` signal), after its question."""
    if answer is None:
        prefix, answer = reference_answer(state)
    prefix, answer = tuple(int(t) for t in prefix), tuple(int(t) for t in answer)
    return state.memo((attention_of_answer, prefix, answer), lambda: attention_of_answer(state, prefix, answer))


def attention_of_answer(state, prefix: tuple[int, ...], answer: tuple[int, ...]) -> torch.Tensor:
    """`answer_attention`'s pass: the answer fed after the prompt and `prefix`, its attention summed."""
    prefix, answer = list(prefix), list(answer)
    scores = torch.zeros(state.num_layers, state.num_kv_heads, state.length, dtype=torch.float32, device=state.device)

    def reduce(layer, queries, new_keys):
        for start, block in causal_attention_rows(queries, state.keys[layer], new_keys, state.scaling):
            answer_rows = max(0, len(prefix) - start)  # rows before the answer (question tokens) do not count
            scores[layer] += block[:, :, answer_rows:].sum(2).mean(1)

    probe_tokens(state.model, state, prefix + answer, reduce)
    return scores


@register_scorer("oracle")
@dataclass(frozen=True)
class OracleScorer(WindowScorer):
    window: int = 0
    knows_answer = True  # a ceiling wherever it is used: alone, in a composition, on a routed layer

    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)

    def requirements(self) -> Requirements:
        return super().requirements().union(Requirements(signals={REFERENCE_ANSWER}))

    def scores(self, state, layer):
        return answer_attention(state)[layer, :, : state.length - min(self.window, state.length)]
