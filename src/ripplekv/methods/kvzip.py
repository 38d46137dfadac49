"""KVzip: question-agnostic importance from how much each entry serves reconstructing the context.

Our reading of Kim et al. (NeurIPS 2025), "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", and of kvpress's KVzipPress and snu-mllab/KVzip (read, not copied). After the prefill the
model is asked to repeat the context: chunk by chunk (`chunk` tokens, 2048 as in the reference), the
tokens "\\n\\nRepeat the previous context exactly." (for later chunks "... the part of the previous context
exactly, starting with" and the previous chunk's last 8 tokens), the chat template's assistant opening
when the tokenizer has one, and the chunk itself are fed after the whole prompt through the full cache.
Each of these queries attends (softmax) over the sink entries, the chunk's own entries and the repeat
tokens so far; an entry's score is the maximum attention any of them (and any query head of its KV head)
pays it. The first `n_sink` (4) entries score 1. Defaults follow the reference: non-layerwise budgets
(all layers and heads compete: the `global` allocator), n_sink 4, chunk 2048. As for SnapKV, the last
`window` (32) tokens are always kept too.

kvpress's KVzipPress differs in three ways, each an option here: it keeps no window (`window=0`); it
reconstructs only what follows the chat template's opening (the system prompt and user header, whose
length it measures on a dummy message), so those entries past the sinks score 0 and go first and the first
chunk's queries also see the sinks (`skip_template=1`); a layer's total need not be a multiple of H_kv
(`granularity=entry` on the `global` allocator). `kvzip:granularity=entry:skip_template=1:window=0` is that
press (make check-references).

Cost: the reconstruction is a second forward over about as many tokens as the prompt (its own phase in
`engine.timings`, `RECONSTRUCTION`, printed by scripts/bench_engine.py): about 2.0 prefills on a 3.5k prompt
on a CPU, since its queries attend over the whole prompt and the repeat so far, about 3 times the causal
prefill's attention. The scores add one product of each query block with its chunk's keys: their softmax's
normaliser comes from the pass's own attention (`ScoringAttention`), and no map over the whole prompt is kept.
The pass stops at the last layer's attention (`continuation.PassDone`): that layer's output, its MLP and the
logits feed no score. That floor is about 2.2 TFLOP on a 3.5k prompt of the bundled model against a prefill's
1.2 (the prompt's linear work again, attention over the whole prompt, the scores' product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ripplekv.engine import timings
from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import FromSample, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_integers, check_positive, register_scorer
from ripplekv.methods.signals.continuation import (
    ROWS,
    PassDone,
    can_split_attention,
    causal_attention_rows,
    lower_right_attention,
    probe_tokens,
)
from ripplekv.methods.snapkv import WindowScorer

FIRST_REQUEST = "\n\nRepeat the previous context exactly."
LATER_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # the previous chunk's last tokens that start a later request
TOKENIZER = "prompt_tokenizer"  # the signal: the prompt's tokenizer, to phrase the request to the model
RECONSTRUCTION = "kvzip reconstruction"  # the pass's phase in `engine.timings` (within its method's build)
_TOKENIZERS: dict = {}


@register_recorder(TOKENIZER)
class PromptTokenizer(FromSample):
    """The tokenizer the sample's prompt was made with (none for a prompt given as ids alone)."""

    def value(self, sample):
        return sample.tokenizer


def tokenizer_of(state):
    """The prompt's tokenizer as the prefill recorded it (the `TOKENIZER` signal), else the one beside the
    model's weights."""
    recorded = state.signal(TOKENIZER, None)
    if recorded is not None:
        return recorded
    where = getattr(getattr(state.model, "config", None), "name_or_path", "") or ""
    if not where:
        raise UserError("kvzip needs the model's tokenizer to phrase its reconstruction request; this model has none")
    if where not in _TOKENIZERS:
        from transformers import AutoTokenizer

        try:
            _TOKENIZERS[where] = AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError):
            raise UserError(f"kvzip needs the model's tokenizer and found none at {where}") from None
    return _TOKENIZERS[where]


def assistant_opening(tokenizer) -> list[int]:
    """The chat template's text between a user message and the answer (empty without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode("\n", add_special_tokens=False)
    marker = "\u2063KVZIP\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text.split(marker, 1)[1], add_special_tokens=False)


def template_opening(tokenizer) -> int:
    """Tokens of the chat template before a user message's text (0 without a template), measured as kvpress's
    KVzipPress measures them."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    marker = "\u2063KVZIP\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text.split(marker, 1)[0], add_special_tokens=False))


def reconstruction_scores(state, n_sink: int, chunk: int, skip_template: int = 0) -> torch.Tensor:
    """Scores [L, H_kv, n] of every prompt entry by the reconstruction pass (computed once per prefill); with
    `skip_template` the pass starts after the chat template's opening, whose entries keep score 0."""
    return state.memo((reconstruct, n_sink, chunk, skip_template),
                      lambda: reconstruct(state, n_sink, chunk, skip_template))


def reconstruct(state, n_sink: int, chunk: int, skip_template: int = 0) -> torch.Tensor:
    """The reconstruction pass itself (see the module docstring), timed as `RECONSTRUCTION`."""
    if state.model is None:
        raise UserError("kvzip needs the model for its reconstruction pass: prefill with the model")
    with timings.phase(RECONSTRUCTION):
        return _reconstruct(state, n_sink, chunk, skip_template)


def replay_chunks(state, chunk: int, skip_template: int):
    """KVzip's replay, chunk by chunk: (tokens, start, stop) for each `chunk`-token slice start:stop of the prompt,
    `tokens` the repeat request (with the end of the slice before, after the first), the assistant's opening and
    the slice. `kvgrad` replays the same way."""
    tokenizer = tokenizer_of(state)
    opening = assistant_opening(tokenizer)
    ids = state.input_ids.tolist()
    length = len(ids)
    first = min(template_opening(tokenizer), length - 1) if skip_template else 0
    for start in range(first, length, chunk):
        stop = min(length, start + chunk)
        request = tokenizer.encode(FIRST_REQUEST if start == first else LATER_REQUEST, add_special_tokens=False)
        if start > first:
            request = request + ids[max(first, start - OVERLAP):start]
        yield request + opening + ids[start:stop], start, stop


def _reconstruct(state, n_sink: int, chunk: int, skip_template: int) -> torch.Tensor:
    length = len(state.input_ids)
    scores = torch.zeros(state.num_layers, state.num_kv_heads, length, dtype=torch.float32, device=state.device)
    for tokens, start, stop in replay_chunks(state, chunk, skip_template):
        probe_tokens(state.model, state, tokens, attend=ScoringAttention(scores, length, min(n_sink, start), start, stop))
    scores[..., :n_sink] = 1.0
    return scores


class ScoringAttention:
    """The reconstruction pass's attention for the chunk [start, stop), which also raises each chunk entry's score
    in `scores` [L, H_kv, n] to the largest attention any repeat query pays it, over the first `sink` entries,
    the chunk and the repeat tokens so far (what those queries see in the reference).

    On a CPU (`continuation.can_split_attention`) the model's own attention comes from flash attentions whose
    log-sum-exps hold that softmax's normaliser (`lower_right_attention` with the sink and the chunk apart), so an
    entry's score is exp(max over queries of logit - normaliser): one product per query block, no softmax.
    Elsewhere sdpa attends and the scores take their own softmax (`causal_attention_rows`); the two agree within
    float tolerance (tests)."""

    def __init__(self, scores: torch.Tensor, length: int, sink: int, start: int, stop: int):
        self.scores, self.length, self.sink, self.start, self.stop = scores, length, sink, start, stop

    def __call__(self, module, query, key, value, mask, scaling):
        layer, n = module.layer_idx, self.length
        last = layer == self.scores.shape[0] - 1  # its output feeds nothing the scores need: the pass stops there
        if not can_split_attention(module, query):
            output = None if last else sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)[0]
            self.score_by_softmax(layer, query[0], key[0], scaling)
        else:
            output, normaliser = lower_right_attention(query, key, value, scaling, output=not last,
                                                       subset=((0, self.sink), (self.start, self.stop), (n, key.shape[2])))
            self.score_by_normaliser(layer, query[0], key[0], normaliser[0], scaling)
        if last:
            raise PassDone
        return output

    def score_by_normaliser(self, layer, query, key, normaliser, scaling):
        kv_heads, length = key.shape[0], query.shape[1]
        group = query.shape[0] // kv_heads
        queries = query.float().view(kv_heads, group, length, -1) * scaling
        chunk_keys = key[:, self.start:self.stop].float().transpose(-1, -2)[:, None]
        normaliser = normaliser.view(kv_heads, group, length, 1)
        best = self.scores[layer, :, self.start:self.stop]
        for begin in range(0, length, ROWS):
            logits = torch.matmul(queries[:, :, begin:begin + ROWS], chunk_keys)
            logits.sub_(normaliser[:, :, begin:begin + ROWS])
            torch.maximum(best, logits.amax(dim=(1, 2)).exp_(), out=best)

    def score_by_softmax(self, layer, query, key, scaling):
        seen = torch.cat([key[:, :self.sink], key[:, self.start:self.stop]], dim=1)
        best = self.scores[layer, :, self.start:self.stop]
        for _, block in causal_attention_rows(query, seen, key[:, self.length:], scaling):
            torch.maximum(best, block[..., self.sink:].amax(dim=(1, 2)), out=best)


@register_scorer("kvzip")
@dataclass(frozen=True)
class KVzipScorer(WindowScorer):
    n_sink: int = 4
    chunk: int = 2048
    skip_template: int = 0

    def __post_init__(self):
        check_positive(chunk=self.chunk)
        check_integers({"n_sink": self.n_sink, "window": self.window}, minimum=0)
        if self.skip_template not in (0, 1):
            raise UserError(f"option skip_template must be 0 or 1, got {self.skip_template!r}")

    def floor(self) -> int:
        return max(self.window, 1)

    def requirements(self) -> Requirements:
        return super().requirements().union(Requirements(signals={TOKENIZER}))

    def scores(self, state, layer):
        window = min(self.window, state.length)
        scores = reconstruction_scores(state, self.n_sink, self.chunk, self.skip_template)
        return scores[layer, :, : state.length - window]
