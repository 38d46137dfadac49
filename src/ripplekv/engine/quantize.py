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

Keys and values may take different bits (`key_bits`, `value_bits`; `bits` sets both): KVTuner (Li et al. 2025)
finds keys more sensitive than values, so `kivi:kbits=4:vbits=2` is its simple baseline. 16 bits keeps that
tensor at the model's own precision (no groups, no minimum or scale), which per-layer bit allocation needs.

Key channels (ThinK, Xu et al. 2024): a spec may store only `key_channels` of each key's channels (the pruned
ones read as zero); the bytes count those channels, quantized or not, plus each head's channel mask (one bit a
channel). Values keep every channel.

This engine dequantizes at once and attends to the dequantized values: memory is *accounted*, not saved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ripplekv.errors import UserError

KEY_AXES = ("channel", "token")
FULL_PRECISION = 16  # "16 bits": the tensor kept at the model's own dtype, not quantized
BITS = (2, 4, 8, FULL_PRECISION)
METADATA_PER_GROUP = 2  # a minimum and a scale, each at the model's dtype


@dataclass(frozen=True)
class QuantSpec:
    """How kept entries are stored: keys at `key_bits`, values at `value_bits` per number (`bits` sets both and,
    after construction, is their one width, None when they differ) in groups of `group`, the last `residual`
    at full precision."""

    key_axis: str = "channel"
    bits: int | None = 2  # KIVI-2, the paper's main setting
    group: int = 32  # KIVI's LongBench setting
    residual: int = 128  # KIVI's LongBench setting
    key_bits: int | None = None  # None: `bits`
    value_bits: int | None = None  # None: `bits`
    key_channels: int | None = None  # None: every channel of a key is stored; else this many (ThinK's pruning)

    def __post_init__(self):
        if self.key_axis not in KEY_AXES:
            raise UserError(f"keys are quantized per {' or per '.join(KEY_AXES)}, not {self.key_axis!r}")
        for key in ("bits", "key_bits", "value_bits"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or value not in BITS):
                raise UserError(f"option {key} must be one of {', '.join(map(str, BITS))}, got {value!r}")
        for key, own in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if own is None and self.bits is None:
                raise UserError(f"give bits, or {key}")
            object.__setattr__(self, key, self.bits if own is None else own)
        object.__setattr__(self, "bits", self.key_bits if self.key_bits == self.value_bits else None)
        for key in ("group", "residual"):
            value = getattr(self, key)
            minimum = 1 if key == "group" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UserError(f"option {key} must be an integer >= {minimum}, got {value!r}")
        if self.key_channels is not None and (isinstance(self.key_channels, bool) or not isinstance(self.key_channels, int)
                                              or self.key_channels < 1):
            raise UserError(f"key_channels must be a positive integer, got {self.key_channels!r}")

    @property
    def is_full_precision(self) -> bool:
        """Keys and values at the model's dtype: nothing to quantize (only key channels may be pruned)."""
        return self.key_bits == FULL_PRECISION and self.value_bits == FULL_PRECISION

    def at(self, bits: int) -> QuantSpec:
        """The same scheme with keys and values at `bits` (a layer's share under per-layer bits)."""
        return QuantSpec(self.key_axis, bits, self.group, self.residual, key_channels=self.key_channels)

    def with_key_channels(self, channels: int | None) -> QuantSpec:
        """The same storage with only `channels` key channels kept (None: all)."""
        return replace(self, bits=None, key_channels=channels)

    def describe(self) -> dict:
        """Its options for config.json: `bits` when keys and values share it (as before key/value bits), else both;
        `key_channels` only when keys are pruned."""
        described = asdict(self)
        drop = ("key_bits", "value_bits") if self.bits is not None else ("bits",)
        drop += () if self.key_channels is not None else ("key_channels",)
        return {key: value for key, value in described.items() if key not in drop}

    def bits_text(self) -> str:
        if self.bits is not None:
            return f"{self.bits} bits"
        return f"{self.key_bits}-bit keys and {self.value_bits}-bit values"


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
    if spec.key_bits == FULL_PRECISION:
        return keys
    if spec.key_axis == "channel":
        return _grouped(keys.transpose(-1, -2), spec.group, spec.key_bits, keys.dtype).transpose(-1, -2).to(keys.dtype)
    return _grouped(keys, spec.group, spec.key_bits, keys.dtype).to(keys.dtype)


def quantize_values(values: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Values [..., m, d] -> dequantized [..., m, d], per token in groups of channels."""
    if spec.value_bits == FULL_PRECISION:
        return values
    return _grouped(values, spec.group, spec.value_bits, values.dtype).to(values.dtype)


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


def tensor_bytes(numbers: int, groups: int, bits: int, element_bytes: int) -> int:
    """Bytes of `numbers` stored at `bits` in `groups` groups: packed integers (rounded up to whole bytes) and a
    minimum and a scale per group; at FULL_PRECISION the numbers themselves, no groups."""
    if bits == FULL_PRECISION:
        return numbers * element_bytes
    return math.ceil(numbers * bits / 8) + METADATA_PER_GROUP * groups * element_bytes


def head_bytes(entries: int, head_dim: int, element_bytes: int, spec: QuantSpec | None) -> int:
    """Bytes one (layer, KV head) holding `entries` K/V entries takes: keys and values each at their bits
    (`tensor_bytes`), and the full-precision residual; without a quantizer, `entries` full-precision keys and
    values. Keys count only their stored channels (`key_channels`), plus the head's channel mask."""
    if spec is None:
        return 2 * entries * head_dim * element_bytes
    channels = head_dim if spec.key_channels is None else min(spec.key_channels, head_dim)
    mask = math.ceil(head_dim / 8) if channels < head_dim and entries else 0  # which channels the head kept
    residual = min(entries, spec.residual)
    quantized = entries - residual
    if spec.key_axis == "channel":
        key_groups = channels * math.ceil(quantized / spec.group)
    else:
        key_groups = quantized * math.ceil(channels / spec.group)
    value_groups = quantized * math.ceil(head_dim / spec.group)
    return (tensor_bytes(quantized * channels, key_groups, spec.key_bits, element_bytes)
            + tensor_bytes(quantized * head_dim, value_groups, spec.value_bits, element_bytes)
            + residual * (channels + head_dim) * element_bytes + mask)
