"""What the one prefill records for the methods that asked: one small recorder per signal.

The prefill runs the model's own attention (sdpa). `ripplekv_attention` hands each layer's queries, keys and
values (post-RoPE) to the recorders passed as `ripplekv_recorders=` and returns sdpa's output unchanged, so
no method's signal changes what another method, or the full-cache reference, sees. A signal that is not
attention is a recorder too: what a sample brings beside its tokens (`SampleContext`: the tokenizer, the
question read after the prompt) and the full cache's answer are kept only when a method declared them.

Each recorder answers one `Requirements` field (`requirement`) and its result lands on the `PrefillState`
under that name (`PrefillState.signal`). A new prefill signal is one recorder here, listed in RECORDERS,
its `Requirements` field, and the methods that read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import adapter
from ripplekv.engine.accumulate import column_sums
from ripplekv.engine.querystats import query_statistics


@dataclass(frozen=True)
class SampleContext:
    """What a sample brings beside its prompt tokens, for the scorers that declare they read it."""

    tokenizer: object = None  # the prompt's tokenizer (Requirements.tokenizer)
    question: tuple[int, ...] = ()  # tokens read after the compressed prompt before the answer (context-only)


@dataclass(frozen=True)
class ReferenceAnswer:
    """The full cache's answer (`tokens`, None until decoded) after the question tokens it reads first."""

    question: tuple[int, ...]
    tokens: tuple[int, ...] | None = None


class Recorder:
    """One signal: reads every prefill attention call (`layer`), then gives its result (`result`)."""

    requirement = ""  # the Requirements field that asks for it; its result's name on the state

    def layer(self, index: int, query, key, value, attention_mask, scaling: float) -> None:
        """Called by each layer's attention with its post-RoPE tensors ([1, H, n, d]); must not change them."""

    def result(self, num_layers: int):
        return None

    def attach(self, model) -> list:
        """Hooks this recorder sets on the model for the prefill's one forward (removed after it); most need none."""
        return []


class PerLayer(Recorder):
    """A recorder whose result is one object per layer."""

    def __init__(self):
        self.layers: dict[int, object] = {}

    def result(self, num_layers: int) -> list:
        return [self.layers[i] for i in range(num_layers)]


class WindowQueries(PerLayer):
    """The last `window` prompt queries per layer [H_q, w, d] (SnapKV's observation window)."""

    requirement = "capture_window"

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def layer(self, index, query, key, value, attention_mask, scaling):
        self.layers[index] = query[0, :, -self.window :, :].detach().clone()


class ColumnSums(PerLayer):
    """Each key's attention summed over every prompt query [H_kv, n] float32 (H2O), in a pass of its own."""

    requirement = "accumulated_attention"

    def layer(self, index, query, key, value, attention_mask, scaling):
        self.layers[index] = column_sums(query, key, scaling, attention_mask)


class QueryMoments(PerLayer):
    """Sums of every prompt query before RoPE (`QueryStatistics`, Expected Attention)."""

    requirement = "query_statistics"

    def __init__(self, model, length: int):
        super().__init__()
        self.model, self.length = model, length
        self.ropes: dict = {}  # (cos, sin, scale) by the layer's RoPE (Gemma 3's differ by layer type)

    def layer(self, index, query, key, value, attention_mask, scaling):
        kind = adapter.rope_kind(self.model, index)
        if kind not in self.ropes:
            probe = torch.zeros(1, device=adapter.device(self.model), dtype=adapter.dtype(self.model))
            cos, sin = adapter.rope_at(self.model, torch.arange(self.length), probe, index)
            self.ropes[kind] = (cos, sin, adapter.rope_scale(self.model, index))
        self.layers[index] = query_statistics(query[0], *self.ropes[kind])


class HiddenStates(PerLayer):
    """Each layer's attention input [n, D] (the hidden state after the layer's input norm, the `hidden_states` a
    kvpress press reads), kept in the model's dtype: KVzap's surrogate scores entries from it. Attention
    never sees it, so a forward pre-hook on each attention module reads it."""

    requirement = "hidden_states"

    def attach(self, model) -> list:
        def keep(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.layers[module.layer_idx] = hidden[0].detach().clone()

        return [layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True)
                for layer in adapter.decoder_layers(model)]


class Probe(Recorder):
    """Hands each layer's queries and keys to `callback(layer, query, key)` (teacher-forced scoring passes)."""

    def __init__(self, callback):
        self.callback = callback

    def layer(self, index, query, key, value, attention_mask, scaling):
        self.callback(index, query, key)


class Given(Recorder):
    """A signal the sample brings (`SampleContext`), kept as it is."""

    def __init__(self, requirement: str, value):
        self.requirement, self.value = requirement, value

    def result(self, num_layers: int):
        return self.value


def recorders_for(needs, model, length: int, window: int, context: SampleContext | None = None) -> list[Recorder]:
    """The recorders a prefill of `length` tokens runs for `needs` (the window queries always)."""
    context = context or SampleContext()
    chosen: list[Recorder] = [WindowQueries(min(window, length))]
    if needs.accumulated_attention:
        chosen.append(ColumnSums())
    if needs.query_statistics:
        chosen.append(QueryMoments(model, length))
    if needs.hidden_states:
        chosen.append(HiddenStates())
    chosen += context_recorders(needs, context)
    return chosen


def context_recorders(needs, context: SampleContext) -> list[Recorder]:
    """What a sample brings, for the requirements that ask (nothing else is kept)."""
    chosen = []
    if needs.tokenizer and context.tokenizer is not None:
        chosen.append(Given("tokenizer", context.tokenizer))
    if needs.reference_answer:
        chosen.append(Given("reference_answer", ReferenceAnswer(tuple(context.question))))
    return chosen


def record_context(state, needs, context: SampleContext) -> None:
    """Keep what `context` brings that `needs` asks for on a state built without a prefill (tests, tools)."""
    for recorder in context_recorders(needs, context):
        state.signals[recorder.requirement] = recorder.result(state.num_layers)


def record_reference(state, tokens) -> None:
    """The full cache's answer, once decoded, for the scorers that declared `reference_answer`; a no-op
    when none did (so callers need not know which methods ran)."""
    reference = state.signals.get("reference_answer")
    if reference is not None:
        state.signals["reference_answer"] = ReferenceAnswer(reference.question, tuple(int(t) for t in tokens))
