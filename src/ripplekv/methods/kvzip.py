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
`engine.timings`, `RECONSTRUCTION`, printed by scripts/bench_engine.py): about 2.3 prefills on a 3.5k prompt
on a CPU, since its queries attend over the whole prompt and the repeat so far, about three times the causal
prefill's attention, and the scores' own attention over each chunk comes on top. That attention is taken
in blocks of queries over one chunk at a time, never as a map over the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import timings
from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import FromSample, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.base import check_integers, check_positive, register_scorer
from ripplekv.methods.continuation import causal_attention_rows, probe_tokens
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


def _reconstruct(state, n_sink: int, chunk: int, skip_template: int) -> torch.Tensor:
    tokenizer = tokenizer_of(state)
    opening = assistant_opening(tokenizer)
    ids = state.input_ids.tolist()
    length = len(ids)
    scores = torch.zeros(state.num_layers, state.num_kv_heads, length, dtype=torch.float32, device=state.device)
    scores[..., :n_sink] = 1.0
    first = min(template_opening(tokenizer), length - 1) if skip_template else 0
    for start in range(first, length, chunk):
        stop = min(length, start + chunk)
        request = tokenizer.encode(FIRST_REQUEST if start == first else LATER_REQUEST, add_special_tokens=False)
        if start > first:
            request = request + ids[max(first, start - OVERLAP):start]
        tokens = request + opening + ids[start:stop]
        sink = min(n_sink, start)

        def reduce(layer, queries, new_keys, start=start, stop=stop, sink=sink):
            keys = state.keys[layer]
            seen = torch.cat([keys[:, :sink], keys[:, start:stop]], dim=1)
            for _, block in causal_attention_rows(queries, seen, new_keys, state.scaling):
                scores[layer, :, start:stop] = torch.maximum(scores[layer, :, start:stop], block[..., sink:].amax(dim=(1, 2)))

        probe_tokens(state.model, state, tokens, reduce, fast=True)
    scores[..., :n_sink] = 1.0
    return scores


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
