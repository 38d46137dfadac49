"""Attention of a decoding step over a compressed cache: ours op by op, or torch's fused kernel (SDPA) where
a device measures it faster.

`our_attention` computes a decoding step's scores, biases and softmax op by op, which reads every
variant's prompt entries where they lie (shared ones are never copied). `fused_attention` hands the same step
to `F.scaled_dot_product_attention`: the kept prompt entries and the decoded tokens as one key sequence, every
bias (padding and log-weights, a sliding window, forced tokens a variant did not produce, decode-budget
evictions) folded into one additive mask, all in float32 whatever the model's dtype. It is the same attention
within float tolerance (tests/test_decode_attention.py). A layer with a per-variant override (RippleKV's noise,
DepthKV's signal) or an evictor (which reads the weights) stays on our path.

Which path a device takes is measured once per device, dtype and attention shape on a synthetic decoding step
(`calibrate`) and kept in `decode_attention.json` in ripplekv's cache folder (`models.cache_root`), so every
later run on that device takes the same path. Our path stays unless the fused one is at least `MARGIN` faster:
a near tie must not flip a device's floats between calibrations. `RIPPLEKV_DECODE_ATTENTION=ours` or `=fused`
sets the path without measuring.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.engine.kept_measurements import device_name, kept_or_measured

PATHS = ("ours", "fused")
MARGIN = 0.9  # the fused path is taken when it takes at most this share of our path's time
FILE = "decode_attention.json"
_chosen: dict[tuple, str] = {}


def compressed_attention(query, layer, new_keys, new_values, scaling: float) -> torch.Tensor:
    """Attention of new queries over a compressed layer's kept prompt entries plus decoded tokens, by the path
    this device takes (`takes_fused`). Returns [V, P, H_q, d]."""
    if takes_fused(layer, query):
        return fused_attention(query, layer, new_keys, new_values, scaling)
    return our_attention(query, layer, new_keys, new_values, scaling)


def _outside_window(layer, new_len: int) -> torch.Tensor:
    """Bool [1 or V, H_kv or 1, P, K]: the prompt entries each new query cannot see on a sliding layer (source
    position at most p - window, for the query at position p)."""
    device = layer.prompt_keys.device
    queries = layer.original_length + layer.decoded_length() - new_len + torch.arange(new_len, device=device)
    positions = layer.prompt_positions
    if positions is None:
        positions = torch.arange(layer.prompt_keys.shape[2], device=device)[None, None]
    return positions[:, :, None, :] <= (queries - layer.window)[None, None, :, None]


def _visible_decoded(layer, new_len: int, decoded: int, device) -> torch.Tensor:
    """Bool [P, T]: the decoded tokens each new query sees. Query p of the P new tokens sits at decoded index
    decoded - P + p and sees decoded keys up to it (on a sliding layer, within its window)."""
    steps = torch.arange(decoded, device=device)
    at = (decoded - new_len + torch.arange(new_len, device=device))[:, None]
    visible = steps[None, :] <= at
    if layer.window is not None:
        visible &= steps[None, :] > at - layer.window
    return visible


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


def our_attention(query, layer, new_keys, new_values, scaling: float) -> torch.Tensor:
    """Attention of new queries over kept prompt entries plus decoded tokens, op by op. Returns [V, P, H_q, d]."""
    num_variants, query_heads, new_len, dim = query.shape
    kv_heads = new_keys.shape[1]
    group = query_heads // kv_heads
    # Query head h serves KV head h // group (transformers' repeat_kv): group rows per KV head.
    rows = query.reshape(num_variants, kv_heads, group * new_len, dim)
    # Scores, bias and softmax in float32 whatever the model dtype (log-weights need the precision).
    prompt_scores = _scores_against(rows, layer.prompt_keys).float() * scaling
    if layer.prompt_bias is not None:
        prompt_scores = prompt_scores + layer.prompt_bias[:, :, None, :]
    if layer.window is not None:  # the model's own sliding eviction: what is past the window is not seen
        prompt_scores = prompt_scores.masked_fill(_outside_window(layer, new_len).repeat(1, 1, group, 1), float("-inf"))
    override = layer.override
    if override is not None and override.key_bias is not None:
        prompt_scores[override.variant] += override.key_bias[:, None, :]
    decoded = new_keys.shape[-2]
    new_scores = torch.matmul(rows, new_keys.transpose(-1, -2)).float() * scaling  # [V, H, g*P, T]
    visible = _visible_decoded(layer, new_len, decoded, query.device)
    new_scores = new_scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
    if layer.hidden is not None:
        new_scores[..., : layer.hidden.shape[-1]] += layer.hidden[:, None, None, :]
    if layer.decoded_bias is not None:
        new_scores[..., : layer.decoded_bias.shape[-1]] += layer.decoded_bias[:, :, None, :]
    weights = torch.softmax(torch.cat([prompt_scores, new_scores], dim=-1), dim=-1)
    if layer.evictor is not None:
        if new_len != 1:
            raise ValueError("a cache under a total decode budget reads one token per step")
        layer.evictor.after_step(weights.view(num_variants, kv_heads, group, -1), query)
    weights = weights.to(new_values.dtype)
    prompt_len = prompt_scores.shape[-1]
    out = _weighted_sum(weights[..., :prompt_len], layer.prompt_values)
    out = out + torch.matmul(weights[..., prompt_len:], new_values)
    if override is not None and override.value_delta is not None:
        v = override.variant
        out[v] = out[v] + torch.matmul(weights[v, :, :, :prompt_len], override.value_delta.to(out.dtype))
    return out.reshape(num_variants, query_heads, new_len, dim).transpose(1, 2).contiguous()


def fused_attention(query, layer, new_keys, new_values, scaling: float) -> torch.Tensor:
    """What `compressed_attention` returns ([V, P, H_q, d]), through one fused SDPA call."""
    num_variants, query_heads, new_len, _ = query.shape
    group = query_heads // new_keys.shape[1]
    keys = torch.cat([layer.prompt_keys.expand(num_variants, -1, -1, -1), new_keys], dim=2).float()
    values = torch.cat([layer.prompt_values.expand(num_variants, -1, -1, -1), new_values], dim=2).float()
    mask = attention_bias(layer, num_variants, new_len, new_keys.shape[2]).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query.float(), keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def attention_bias(layer, num_variants: int, new_len: int, decoded: int) -> torch.Tensor:
    """The additive float32 mask [V, H_kv, P, K + T] of one step: what `compressed_attention` adds to its
    scores, as one tensor (0 where an entry counts as itself, -inf where it is not seen)."""
    device = layer.prompt_keys.device
    kv_heads, kept = layer.prompt_keys.shape[1], layer.prompt_keys.shape[2]
    prompt = torch.zeros(1, 1, new_len, kept, device=device)
    if layer.prompt_bias is not None:
        prompt = prompt + layer.prompt_bias[:, :, None, :]
    if layer.window is not None:
        prompt = prompt.masked_fill(_outside_window(layer, new_len), float("-inf"))
    visible = _visible_decoded(layer, new_len, decoded, device)
    new = torch.zeros(new_len, decoded, device=device).masked_fill(~visible, float("-inf"))[None, None]
    if layer.hidden is not None:
        hidden = torch.zeros(num_variants, 1, 1, decoded, device=device)
        hidden[..., : layer.hidden.shape[-1]] = layer.hidden[:, None, None, :]
        new = new + hidden
    if layer.decoded_bias is not None:
        extra = torch.zeros(num_variants, kv_heads, 1, decoded, device=device)
        extra[..., : layer.decoded_bias.shape[-1]] = layer.decoded_bias[:, :, None, :]
        new = new + extra
    shape = (num_variants, kv_heads, new_len)
    return torch.cat([prompt.expand(*shape, kept), new.expand(*shape, decoded)], dim=-1)


def takes_fused(layer, query: torch.Tensor) -> bool:
    """Whether this step goes through `fused_attention`: the device's path, for a layer without overrides."""
    if layer.override is not None or layer.evictor is not None:
        return False
    key = (query.device.type, query.device.index, query.dtype, layer.prompt_keys.shape[1],
           query.shape[1] // layer.prompt_keys.shape[1], query.shape[-1])
    if key not in _chosen:
        _chosen[key] = device_path(query.device, query.dtype, *key[3:], type(layer))
    return _chosen[key] == "fused"


def device_path(device: torch.device, dtype: torch.dtype, kv_heads: int, group: int, dim: int, layer_type) -> str:
    """The path this device takes for this attention shape: the environment's, the one measured before, or
    measured now (and kept) on a synthetic `layer_type` (`cache.CompressedLayer`, which imports this module)."""
    forced = os.environ.get("RIPPLEKV_DECODE_ATTENTION", "").strip().lower()
    if forced:
        if forced not in PATHS:
            from ripplekv.errors import UserError

            raise UserError(f"RIPPLEKV_DECODE_ATTENTION must be one of {', '.join(PATHS)}, got {forced!r}")
        return forced
    entry = (f"{device_name(device)} | torch {torch.__version__} | {str(dtype).removeprefix('torch.')} | "
             f"{kv_heads}x{group}x{dim}")
    kept = kept_or_measured(FILE, entry, lambda kept: isinstance(kept, dict) and kept.get("path") in PATHS,
                            lambda: calibrate(device, dtype, kv_heads, group, dim, layer_type))
    return kept["path"]


@dataclass(frozen=True)
class Trial:
    """The synthetic layer `calibrate` times (`variants` caches of up to `kept` padded entries, `decoded` tokens so
    far, one new token each) and how: `calls` calls a round, `rounds` rounds after a warm-up one."""

    variants: int = 16
    kept: int = 512
    decoded: int = 16
    rounds: int = 7
    calls: int = 10


def calibrate(device, dtype, kv_heads: int, group: int, dim: int, layer_type, trial: Trial = Trial()) -> dict:
    """Time a decoding step's attention both ways on `trial`'s synthetic layer of this shape, alternating
    within each round; median ms a call."""
    variants, kept, decoded, rounds, calls = trial.variants, trial.kept, trial.decoded, trial.rounds, trial.calls
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    bias = torch.zeros(variants, kv_heads, kept)
    for row in range(1, variants):  # padded as length-sorted variants are: each row 8 entries shorter, one kept
        bias[row, :, max(kept - 8 * row, 1) :] = float("-inf")
    layer = layer_type(draw(variants, kv_heads, kept, dim), draw(variants, kv_heads, kept, dim), bias.to(device), kept)
    layer.update(draw(variants, kv_heads, decoded, dim), draw(variants, kv_heads, decoded, dim))
    query = draw(variants, kv_heads * group, 1, dim)
    new_keys, new_values = layer.keys, layer.values
    ways = {"ours": lambda: our_attention(query, layer, new_keys, new_values, dim**-0.5),
            "fused": lambda: fused_attention(query, layer, new_keys, new_values, dim**-0.5)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(rounds + 1):
        for name, way in ways.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                way()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:  # the first round warms both up
                times[name].append(1e3 * (time.perf_counter() - start) / calls)
    ours, fused = (statistics.median(times[name]) for name in PATHS)
    path = "fused" if fused <= MARGIN * ours else "ours"
    return {"path": path, "ours_ms": round(ours, 4), "fused_ms": round(fused, 4)}
