"""Quantize-dequantize of kept K/V entries and the bytes they take (the memory axis).

A quantizer stores each (layer, KV head)'s kept entries at `bits` bits, asymmetrically: every group of
`group` numbers has a minimum and a scale (stored at the model's dtype), and a number becomes
`round((x - min) / scale)` in [0, 2^bits - 1]. Values are grouped per token (`group` consecutive channels
of one entry); keys either per channel (`key_axis="channel"`, KIVI's choice, Liu et al. 2024: a group is
`group` consecutive entries of one channel, since key outliers sit in fixed channels) or per token like
the values (`key_axis="token"`, FlexGen's simple scheme).
The last `residual` entries (by prompt position) stay at full precision, as KIVI's recent-token window.

One deliberate difference from KIVI's prefill code: KIVI keeps `n mod residual` recent keys at full
precision so its kernel only sees whole groups; here the residual is the last `residual` entries for keys
and values alike, and a last, partial key group is quantized with its own minimum and scale (counted in
the bytes). So bytes grow with every entry kept, which "as many entries as the bytes allow" needs.

This engine dequantizes at once and attends to the dequantized values: memory is *accounted*, not saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ripplekv.errors import UserError

KEY_AXES = ("channel", "token")
BITS = (2, 4, 8)
METADATA_PER_GROUP = 2  # a minimum and a scale, each at the model's dtype


@dataclass(frozen=True)
class QuantSpec:
    """How kept entries are stored: `bits` per number in groups of `group`, the last `residual` at full precision."""

    key_axis: str = "channel"
    bits: int = 2  # KIVI-2, the paper's main setting
    group: int = 32  # KIVI's LongBench setting
    residual: int = 128  # KIVI's LongBench setting

    def __post_init__(self):
        if self.key_axis not in KEY_AXES:
            raise UserError(f"keys are quantized per {' or per '.join(KEY_AXES)}, not {self.key_axis!r}")
        if self.bits not in BITS:
            raise UserError(f"option bits must be one of {', '.join(map(str, BITS))}, got {self.bits!r}")
        for key in ("group", "residual"):
            value = getattr(self, key)
            minimum = 1 if key == "group" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UserError(f"option {key} must be an integer >= {minimum}, got {value!r}")


def quantize_groups(x: torch.Tensor, bits: int, meta_dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize `x` [..., G] group-wise along its last dimension (float32 out).

    The minimum and scale are rounded to `meta_dtype` first (that is how they are stored), then used both to
    quantize and to dequantize; a constant group (scale 0) comes back as its minimum."""
    x = x.float()
    low = x.amin(-1, keepdim=True).to(meta_dtype).float()
    high = x.amax(-1, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).to(meta_dtype).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = torch.clamp(torch.round((x - low) / safe), 0, 2**bits - 1)
    return torch.where(scale > 0, levels * scale + low, low.expand_as(x))


def _grouped(x: torch.Tensor, group: int, bits: int, meta_dtype) -> torch.Tensor:
    """Quantize-dequantize `x` [..., m] in groups of `group` along m; a last partial group is its own group."""
    *lead, m = x.shape
    whole = (m // group) * group
    x = x.float().contiguous()
    parts = []
    if whole:
        parts.append(quantize_groups(x[..., :whole].reshape(*lead, whole // group, group), bits, meta_dtype)
                     .reshape(*lead, whole))
    if whole < m:
        parts.append(quantize_groups(x[..., whole:], bits, meta_dtype))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def quantize_keys(keys: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Keys [..., m, d] (all quantized: no residual here) -> dequantized [..., m, d] at the keys' dtype."""
    if spec.key_axis == "channel":
        return _grouped(keys.transpose(-1, -2), spec.group, spec.bits, keys.dtype).transpose(-1, -2).to(keys.dtype)
    return _grouped(keys, spec.group, spec.bits, keys.dtype).to(keys.dtype)


def quantize_values(values: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Values [..., m, d] -> dequantized [..., m, d], per token in groups of channels."""
    return _grouped(values, spec.group, spec.bits, values.dtype).to(values.dtype)


def quantize_head(keys: torch.Tensor, values: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries [..., n, d] in prompt order (one head, or heads that keep the same number) -> the entries
    attention reads: every entry but the last `residual` quantize-dequantized, those left untouched."""
    quantized = max(keys.shape[-2] - spec.residual, 0)
    if quantized == 0:
        return keys, values
    keys, values = keys.clone(), values.clone()
    keys[..., :quantized, :] = quantize_keys(keys[..., :quantized, :], spec)
    values[..., :quantized, :] = quantize_values(values[..., :quantized, :], spec)
    return keys, values


def head_bytes(entries: int, head_dim: int, element_bytes: int, spec: QuantSpec | None) -> int:
    """Bytes one (layer, KV head) holding `entries` K/V entries takes: the packed integers (rounded up to
    whole bytes per tensor), a minimum and a scale per group, and the full-precision residual; without a
    quantizer, `entries` full-precision keys and values."""
    if spec is None:
        return 2 * entries * head_dim * element_bytes
    residual = min(entries, spec.residual)
    quantized = entries - residual
    packed = 2 * math.ceil(quantized * head_dim * spec.bits / 8)
    if spec.key_axis == "channel":
        key_groups = head_dim * math.ceil(quantized / spec.group)
    else:
        key_groups = quantized * math.ceil(head_dim / spec.group)
    value_groups = quantized * math.ceil(head_dim / spec.group)
    metadata = METADATA_PER_GROUP * (key_groups + value_groups) * element_bytes
    return packed + metadata + 2 * residual * head_dim * element_bytes
