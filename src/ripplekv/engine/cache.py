"""A KV cache whose layers (and heads) keep different numbers of prompt entries, for several variants at once.

It is built from entries (`ripplekv.engine.entries`): each layer holds the prompt entries of every variant padded
to the layer's longest, with an additive key bias (the entries' log-weights: 0 for a token, log m for a
prototype, -inf on padding), followed by the tokens decoded so far (the same count for every variant).
Attention over it is our own function (`engine.decode_attention`: op by op, or one fused SDPA call on a device
where that measures faster), registered in transformers' AttentionInterface under the name `ripplekv`, so it
works with any backend and any per-head lengths (kvpress needs flash attention for this).

When every variant keeps the same prompt entries (the full cache, or profiling, where variants differ only
by a value perturbation in one layer), the prompt part is stored once and shared: variants are folded
into the query rows instead of copying keys V times.

A sliding-window layer (Gemma's local layers) evicts as the model does while decoding: a query at position
p sees only entries from positions after p - window, whatever a method kept (`slide`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ripplekv.engine import entries, timings
from ripplekv.engine.decode_attention import compressed_attention
from ripplekv.engine.entries import LayerEntries

ATTENTION_NAME = "ripplekv"


@dataclass
class VariantOverride:
    """Change one variant in one layer without copying the shared prompt entries.

    `value_delta` [H_kv, K, d] is added to its values (RippleKV's noise); `key_bias` [H_kv, K] is added
    to its attention scores (-inf evicts entries: the DepthKV-style signal).
    """

    variant: int
    value_delta: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None


class CompressedLayer(CacheLayerMixin):
    """One layer: padded kept prompt entries (shared or per variant) plus decoded tokens."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, prompt_keys, prompt_values, prompt_bias, original_length: int, override: VariantOverride | None = None):
        super().__init__()
        self.prompt_keys = prompt_keys  # [1 or V, H_kv, K, d]
        self.prompt_values = prompt_values
        self.prompt_bias = prompt_bias  # [1 or V, H_kv, K] additive, or None when nothing is padded
        self.override = override
        self.original_length = original_length
        self.keys = None  # decoded tokens: [V, H_kv, T, d]
        self.values = None
        # Additive bias [V, T0] over the first T0 decoded tokens (None: all visible). Divergence decoding
        # hides the teacher-forced tokens a variant did not produce (those past its first disagreement).
        self.hidden = None
        # Under a total decode budget (`engine.evict`): bias [V, H_kv, T] over decoded tokens (-inf on the ones
        # evicted) and the evictor that keeps every head at its count; None otherwise.
        self.decoded_bias = None
        self.evictor = None
        # A sliding-window layer: its window, and the source positions [1 or V, H_kv, K] of its prompt entries
        # (None: positions 0..K-1); None on a layer that sees the whole context.
        self.window: int | None = None
        self.prompt_positions = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - built eagerly
        pass

    def slide(self, window: int | None, positions: torch.Tensor | None = None) -> CompressedLayer:
        """Make this a sliding-window layer of `window` whose prompt entries come from `positions`
        ([1 or V, H_kv, K]; None: 0..K-1). A window of None leaves the layer seeing everything."""
        self.window, self.prompt_positions = window, (positions if window is not None else None)
        return self

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def decoded_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        # Positions continue from the original prompt length, not the compressed one.
        return self.original_length + self.decoded_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the same question under its older name (abstract in transformers 5.2)
        return -1

    def batch_select_indices(self, indices: torch.Tensor, in_place: bool = False) -> None:
        """Keep (or reorder, or repeat) the variants in `indices`: finished variants leave the batch.

        `in_place`: `indices` only drop variants (increasing), and this layer owns its prompt entries, so their
        rows move down in place instead of being copied (no second copy of the largest tensors)."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.prompt_keys.device)
        if self.prompt_keys.shape[0] > 1:
            self.prompt_keys = _keep_rows(self.prompt_keys, index, in_place)
            self.prompt_values = _keep_rows(self.prompt_values, index, in_place)
        if self.prompt_bias is not None and self.prompt_bias.shape[0] > 1:
            self.prompt_bias = _keep_rows(self.prompt_bias, index, in_place)
        if self.prompt_positions is not None and self.prompt_positions.shape[0] > 1:
            self.prompt_positions = self.prompt_positions.index_select(0, index)
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)
        if self.hidden is not None:
            self.hidden = self.hidden.index_select(0, index)
        if self.decoded_bias is not None:
            self.decoded_bias = self.decoded_bias.index_select(0, index)
        if self.evictor is not None:
            self.evictor.select(index)
        if self.override is not None:
            hits = (index == self.override.variant).nonzero()
            self.override = (
                VariantOverride(int(hits[0, 0]), self.override.value_delta, self.override.key_bias)
                if len(hits)
                else None
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search reorders the batch: the same as selecting variants."""
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop decoded tokens (negative: that many from the end; positive: keep that many in total).

        The compressed prompt entries cannot be cropped: they are not a prefix of the prompt any more.
        """
        decoded = self.decoded_length()
        keep = decoded + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove - self.original_length
        if keep < 0:
            raise ValueError("a compressed cache can only crop decoded tokens, not its prompt entries")
        if self.keys is not None and keep < decoded:
            self.keys = self.keys[..., :keep, :]
            self.values = self.values[..., :keep, :]


class CompressedCache(Cache):
    """A transformers Cache made of `CompressedLayer`s: pass it as `cache=` (or `past_key_values=`) to the model."""

    def __init__(self, layers: list[CompressedLayer], num_variants: int):
        super().__init__(layers=layers)
        self.num_variants = num_variants

    def select_variants(self, index: torch.Tensor, in_place: bool = False) -> None:
        """Keep the variants `index`; `in_place` as `CompressedLayer.batch_select_indices` says."""
        for layer in self.layers:
            layer.batch_select_indices(index, in_place)
        self.num_variants = len(index)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Append decoded tokens, and hand this cache to our attention function.

        The attention modules of the supported families pass their own keyword arguments here
        (`kwargs=`) and then on to the attention function, so putting the cache in them lets a plain
        `model.generate(past_key_values=cache)` reach `compressed_attention` with no extra argument.
        """
        forwarded = kwargs.get("kwargs")
        if isinstance(forwarded, dict):
            forwarded.setdefault("ripplekv_cache", self)
        return self.layers[layer_idx].update(key_states, value_states)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every variant `repeats` times (generate's num_return_sequences and beams)."""
        self.batch_select_indices(torch.arange(self.num_variants).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self.num_variants = len(indices)


def build_cache(state, variants: list[list[LayerEntries]] | None, num_variants: int | None = None) -> CompressedCache:
    """A cache for several variants of one prefilled prompt.

    `variants`: per variant, one `LayerEntries` per layer; None for the full cache shared by
    `num_variants` variants. A layer whose entries are the same object in every variant (the full
    layer, or profiling's shared cache) is stored once and never copied.
    """
    layers = []
    for layer_idx in range(state.num_layers):
        if variants is None:
            shared = state.full_entries(layer_idx)
        else:
            chosen = [variant[layer_idx] for variant in variants]
            shared = chosen[0] if all(entry is chosen[0] for entry in chosen) else None
        window = _window(state, layer_idx)
        if shared is not None:
            layers.append(CompressedLayer(shared.keys[None], shared.values[None], _unsqueeze(shared.bias()), state.length)
                          .slide(window, shared.positions[None]))
            continue
        keys, values, bias = entries.pad_variants(chosen)
        layers.append(CompressedLayer(keys, values, bias, state.length)
                      .slide(window, _padded_positions(chosen) if window is not None else None))
    count = len(variants) if variants is not None else (num_variants or 1)
    return CompressedCache(layers, count)


def build_lazily(state, builds, lengths: list[list[int]]) -> CompressedCache:
    """`build_cache` for variants built one at a time: `builds` yields each variant's entries in turn (a
    generator), `lengths[v]` variant v's entries per layer (padded across heads). Each variant's entries are copied into the cache as soon as
    they are built and then dropped, so the cache and one variant's entries are all that exist at once. A
    layer that every variant keeps whole (the prefill's own entries object) is stored once, as there."""
    count = len(lengths)
    layers: list[list] = [[None, None, None, None] for _ in range(state.num_layers)]  # shared, keys, values, bias
    positions: list = [None] * state.num_layers  # a sliding layer's stacked entry positions (-1 on padding)
    for row, variant in enumerate(builds):
        for layer_idx, entry in enumerate(variant):
            slot = layers[layer_idx]
            if slot[1] is None and (row == 0 or entry is slot[0]):
                slot[0] = entry
                continue
            if slot[1] is None:  # the first variant that differs: stack the shared rows before it
                longest = max(length[layer_idx] for length in lengths)
                slot[1] = entry.keys.new_zeros(count, entry.num_heads, longest, entry.keys.shape[-1])
                slot[2] = torch.zeros_like(slot[1])
                if _window(state, layer_idx) is not None:
                    positions[layer_idx] = torch.full(slot[1].shape[:3], -1, dtype=torch.long, device=slot[1].device)
                for earlier in range(row):
                    _put(slot, earlier, slot[0], positions[layer_idx])
            _put(slot, row, entry, positions[layer_idx])
    built = []
    for layer_idx, (shared, keys, values, bias) in enumerate(layers):
        window = _window(state, layer_idx)
        if keys is None:
            built.append(CompressedLayer(shared.keys[None], shared.values[None], _unsqueeze(shared.bias()), state.length)
                         .slide(window, shared.positions[None]))
        else:
            built.append(CompressedLayer(keys, values, bias, state.length).slide(window, positions[layer_idx]))
    return CompressedCache(built, count)


def _put(slot: list, row: int, entry: LayerEntries, positions: torch.Tensor | None = None) -> None:
    """Copy one variant's entries into row `row` of a stacked layer, padded as `entries.pad_variants` pads
    (bias -inf past its entries; no bias tensor while every row is unpadded plain tokens); on a sliding layer
    their positions into `positions` too."""
    keys = slot[1]
    if entry.capacity > keys.shape[2]:
        raise ValueError(f"a variant built {entry.capacity} entries in a layer planned for {keys.shape[2]}")
    keys[row, :, : entry.capacity] = entry.keys
    slot[2][row, :, : entry.capacity] = entry.values
    if positions is not None:
        positions[row, :, : entry.capacity] = entry.positions
    bias = entry.bias()
    if slot[3] is None and (bias is not None or entry.capacity < keys.shape[2]):
        slot[3] = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
    if slot[3] is not None:
        slot[3][row, :, : entry.capacity] = 0.0 if bias is None else bias
        slot[3][row, :, entry.capacity :] = float("-inf")


def _keep_rows(tensor: torch.Tensor, index: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Rows `index` of `tensor`: copied, or (`in_place`, `index` increasing) moved down within it."""
    if not in_place:
        return tensor.index_select(0, index)
    for target, source in enumerate(index.tolist()):
        if source < target:
            raise ValueError("an in-place selection keeps variants in order")
        if source != target:
            tensor[target].copy_(tensor[source])
    return tensor[: len(index)]


def _unsqueeze(bias):
    return None if bias is None else bias[None]


def _window(state, layer: int) -> int | None:
    """The sliding window of `layer` (None: it sees the whole context, or the state predates windows)."""
    return state.window(layer) if hasattr(state, "window") else None


def _padded_positions(layers: list[LayerEntries]) -> torch.Tensor:
    """The entries' positions of one layer's variants stacked [V, H_kv, K], -1 on padding (as `pad_variants`)."""
    longest = max(entry.capacity for entry in layers)
    return torch.stack([torch.nn.functional.pad(e.positions, (0, longest - e.capacity), value=-1) for e in layers])


def ripplekv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention: compressed attention when a CompressedCache is active, else sdpa.

    `ripplekv_attend(module, query, key, value, mask, scaling)` replaces sdpa (a probing pass's attention).
    The recorders passed as `ripplekv_recorders` (`engine.recorders`: the prefill's window queries and the
    signals methods registered, a scoring pass's probe) each read this layer's post-RoPE queries, keys
    and values; none changes the output, which is always the model's own attention.
    """
    cache, attend = kwargs.pop("ripplekv_cache", None), kwargs.pop("ripplekv_attend", None)
    for recorder in kwargs.pop("ripplekv_recorders", ()):
        with timings.phase(timings.RECORDER + recorder.signal) if recorder.signal else nullcontext():
            recorder.layer(module.layer_idx, query, key, value, attention_mask, scaling or module.scaling)
    if cache is not None:
        layer = cache.layers[module.layer_idx]
        return compressed_attention(query, layer, key, value, scaling or module.scaling), None
    if attend is not None:  # a pass's own attention (`methods.signals.continuation`)
        return attend(module, query, key, value, attention_mask, scaling or module.scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def install(model) -> None:
    """Register our attention (and sdpa's mask builder under its name) and switch the model to it."""
    AttentionInterface.register(ATTENTION_NAME, ripplekv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
