"""A KV cache whose layers (and heads) keep different numbers of prompt entries, for several variants at once.

Each layer holds the kept prompt entries of every variant padded to the layer's longest, with an additive
key bias (0 kept, -inf padding), followed by the tokens decoded so far (the same count for every variant).
Attention over it is our own function, registered in transformers' AttentionInterface under the name
`ripplekv`, so it works with any backend and any per-head lengths (kvpress needs flash attention for this).

When every variant keeps the same prompt entries (the full cache, or profiling, where variants differ only
by a value perturbation in one layer), the prompt part is stored once and shared: variants are folded
into the query rows instead of copying keys V times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

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

    def __init__(self, prompt_keys, prompt_values, prompt_bias, original_length: int, override: VariantOverride | None = None):
        super().__init__()
        self.prompt_keys = prompt_keys  # [1 or V, H_kv, K, d]
        self.prompt_values = prompt_values
        self.prompt_bias = prompt_bias  # [1 or V, H_kv, K] additive, or None when nothing is padded
        self.override = override
        self.original_length = original_length
        self.keys = None  # decoded tokens: [V, H_kv, T, d]
        self.values = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - built eagerly
        pass

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

    def select_variants(self, index: torch.Tensor) -> None:
        """Keep only the variants in `index` (finished variants leave the batch)."""
        if self.prompt_keys.shape[0] > 1:
            self.prompt_keys = self.prompt_keys.index_select(0, index)
            self.prompt_values = self.prompt_values.index_select(0, index)
        if self.prompt_bias is not None and self.prompt_bias.shape[0] > 1:
            self.prompt_bias = self.prompt_bias.index_select(0, index)
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)
        if self.override is not None:
            hits = (index == self.override.variant).nonzero()
            self.override = (
                VariantOverride(int(hits[0, 0]), self.override.value_delta, self.override.key_bias)
                if len(hits)
                else None
            )


class CompressedCache(Cache):
    """A transformers Cache made of `CompressedLayer`s; pass it as `cache=` and as `ripplekv_cache=`."""

    def __init__(self, layers: list[CompressedLayer], num_variants: int):
        super().__init__(layers=layers)
        self.num_variants = num_variants

    def select_variants(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_variants(index)
        self.num_variants = len(index)


def gather_selection(keys: torch.Tensor, values: torch.Tensor, masks: torch.Tensor):
    """Kept entries of one layer for V variants, padded to the longest head.

    keys/values: [H_kv, n, d]; masks: [V, H_kv, n] bool. Returns keys/values [V, H_kv, K, d] and an
    additive bias [V, H_kv, K] (None when no head needs padding). Kept entries stay in original order.
    """
    counts = masks.sum(-1)  # [V, H]
    longest = int(counts.max())
    # Stable sort puts kept positions first, in ascending order.
    order = torch.argsort((~masks).to(torch.int8), dim=-1, stable=True)[..., :longest]  # [V, H, K]
    heads = torch.arange(keys.shape[0])[None, :, None]
    kept_keys = keys[heads, order]
    kept_values = values[heads, order]
    if bool((counts == longest).all()):
        return kept_keys, kept_values, None
    valid = torch.arange(longest)[None, None, :] < counts[..., None]
    bias = torch.zeros(valid.shape, dtype=keys.dtype).masked_fill(~valid, float("-inf"))
    return kept_keys, kept_values, bias


def build_cache(state, selections: list[torch.Tensor] | None, num_variants: int | None = None) -> CompressedCache:
    """A cache for several variants of one prefilled prompt.

    `selections`: one bool mask [L, H_kv, n] per variant, or None for the full cache shared by
    `num_variants` variants (no copies).
    """
    layers = []
    for layer_idx in range(state.num_layers):
        keys, values = state.keys[layer_idx], state.values[layer_idx]
        if selections is None:
            layers.append(CompressedLayer(keys[None], values[None], None, state.length))
            continue
        masks = torch.stack([s[layer_idx] for s in selections])
        if bool(masks.all()):
            layers.append(CompressedLayer(keys[None], values[None], None, state.length))
            continue
        kept_keys, kept_values, bias = gather_selection(keys, values, masks)
        layers.append(CompressedLayer(kept_keys, kept_values, bias, state.length))
    variants = len(selections) if selections is not None else (num_variants or 1)
    return CompressedCache(layers, variants)


def _scores_against(query_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query_rows [V, H, R, d] against keys [1 or V, H, K, d] -> [V, H, R, K], sharing keys without copies."""
    num_variants, heads, rows, dim = query_rows.shape
    if keys.shape[0] == 1 and num_variants > 1:
        folded = query_rows.permute(1, 0, 2, 3).reshape(heads, num_variants * rows, dim)
        scores = torch.matmul(folded, keys[0].transpose(-1, -2))
        return scores.view(heads, num_variants, rows, -1).permute(1, 0, 2, 3)
    return torch.matmul(query_rows, keys.transpose(-1, -2))


def _weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights [V, H, R, K] times values [1 or V, H, K, d] -> [V, H, R, d], sharing values without copies."""
    num_variants, heads, rows, length = weights.shape
    if values.shape[0] == 1 and num_variants > 1:
        folded = weights.permute(1, 0, 2, 3).reshape(heads, num_variants * rows, length)
        out = torch.matmul(folded, values[0])
        return out.view(heads, num_variants, rows, -1).permute(1, 0, 2, 3)
    return torch.matmul(weights, values)


def compressed_attention(query, layer: CompressedLayer, new_keys, new_values, scaling: float) -> torch.Tensor:
    """Attention of new queries over kept prompt entries plus decoded tokens. Returns [V, P, H_q, d]."""
    num_variants, query_heads, new_len, dim = query.shape
    kv_heads = new_keys.shape[1]
    group = query_heads // kv_heads
    # Query head h serves KV head h // group (transformers' repeat_kv): group rows per KV head.
    rows = query.reshape(num_variants, kv_heads, group * new_len, dim)
    prompt_scores = _scores_against(rows, layer.prompt_keys) * scaling
    if layer.prompt_bias is not None:
        prompt_scores = prompt_scores + layer.prompt_bias[:, :, None, :]
    override = layer.override
    if override is not None and override.key_bias is not None:
        prompt_scores[override.variant] += override.key_bias[:, None, :]
    decoded = new_keys.shape[-2]
    new_scores = torch.matmul(rows, new_keys.transpose(-1, -2)) * scaling  # [V, H, g*P, T]
    # Query p of the P new tokens sits at decoded index decoded - P + p and sees decoded keys up to it.
    visible = torch.arange(decoded)[None, :] <= (decoded - new_len + torch.arange(new_len))[:, None]
    new_scores = new_scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
    weights = torch.softmax(torch.cat([prompt_scores, new_scores], dim=-1).float(), dim=-1).to(query.dtype)
    prompt_len = prompt_scores.shape[-1]
    out = _weighted_sum(weights[..., :prompt_len], layer.prompt_values)
    out = out + torch.matmul(weights[..., prompt_len:], new_values)
    if override is not None and override.value_delta is not None:
        v = override.variant
        out[v] = out[v] + torch.matmul(weights[v, :, :, :prompt_len], override.value_delta)
    return out.reshape(num_variants, query_heads, new_len, dim).transpose(1, 2).contiguous()


def ripplekv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention: compressed attention when a CompressedCache is active, else sdpa.

    During prefill it also records the observation-window queries (post-RoPE) that SnapKV scoring needs.
    """
    cache = kwargs.pop("ripplekv_cache", None)
    capture = kwargs.pop("ripplekv_capture", None)
    if cache is not None:
        layer = cache.layers[module.layer_idx]
        return compressed_attention(query, layer, key, value, scaling or module.scaling), None
    if capture is not None:
        capture[module.layer_idx] = query[0, :, -capture["window"] :, :].detach().clone()
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def install(model) -> None:
    """Register our attention (and sdpa's mask builder under its name) and switch the model to it."""
    AttentionInterface.register(ATTENTION_NAME, ripplekv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
