"""The KIVI quantizer against an independent, loop-by-loop reading of the scheme, and its byte count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ripplekv.engine.quantize import QuantSpec, head_bytes, quantize_head
from ripplekv.errors import UserError


def naive_group(numbers: np.ndarray, bits: int, meta) -> np.ndarray:
    """One group, written out: the stored minimum and scale, integer levels, then back."""
    low = np.float32(meta(numbers.min()))
    scale = np.float32(meta((np.float32(numbers.max()) - low) / np.float32(2**bits - 1)))
    if scale == 0:
        return np.full_like(numbers, low)
    out = np.empty_like(numbers)
    for i, x in enumerate(numbers):
        level = min(max(np.round((np.float32(x) - low) / scale), 0), 2**bits - 1)
        out[i] = np.float32(level) * scale + low
    return out


def naive_quantize(keys, values, bits, group, residual, per_channel_keys=True, meta=np.float32):
    """Independent reading: the first n - residual entries quantized (keys per channel in runs of `group` entries,
    or per token; values per token in runs of `group` channels), the rest copied."""
    keys, values = keys.astype(np.float32), values.astype(np.float32)
    n, d = keys.shape
    q = max(n - residual, 0)
    k_out, v_out = keys.copy(), values.copy()
    for start in range(0, q, group):
        stop = min(start + group, q)
        if per_channel_keys:
            for c in range(d):
                k_out[start:stop, c] = naive_group(keys[start:stop, c], bits, meta)
    for t in range(q):
        for start in range(0, d, group):
            stop = min(start + group, d)
            v_out[t, start:stop] = naive_group(values[t, start:stop], bits, meta)
            if not per_channel_keys:
                k_out[t, start:stop] = naive_group(keys[t, start:stop], bits, meta)
    return k_out, v_out


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n,d,group,residual", [(100, 16, 8, 20), (37, 12, 5, 0), (9, 8, 4, 12), (64, 32, 32, 16)])
@pytest.mark.parametrize("scheme", ["channel", "token"])
def test_quantize_dequantize_matches_an_independent_reading(bits, n, d, group, residual, scheme):
    generator = torch.Generator().manual_seed(n * d + bits)
    keys = torch.randn(n, d, generator=generator) * torch.linspace(0.1, 5, d)  # outlier channels, as real keys
    values = torch.randn(n, d, generator=generator)
    spec = QuantSpec(key_axis=scheme, bits=bits, group=group, residual=residual)
    got_k, got_v = quantize_head(keys, values, spec)
    want_k, want_v = naive_quantize(keys.numpy(), values.numpy(), bits, group, residual, scheme == "channel")
    # float rounding only: both compute in float32 with the same stored minimum and scale
    np.testing.assert_allclose(got_k.numpy(), want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_v.numpy(), want_v, rtol=1e-6, atol=1e-6)
    kept = max(n - residual, 0)
    assert torch.equal(got_k[kept:], keys[kept:]) and torch.equal(got_v[kept:], values[kept:])  # residual untouched
    if kept and bits < 8:
        assert not torch.equal(got_k[:kept], keys[:kept])  # something was quantized


def test_metadata_is_stored_at_the_models_dtype():
    """A half-precision model stores its minimum and scale in half precision: the same levels, half-rounded."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(40, 16, generator=generator).to(torch.float16)
    values = torch.randn(40, 16, generator=generator).to(torch.float16)
    got_k, got_v = quantize_head(keys, values, QuantSpec(bits=4, group=8, residual=8))
    half = lambda x: np.float32(np.float16(x))  # noqa: E731
    want_k, want_v = naive_quantize(keys.float().numpy(), values.float().numpy(), 4, 8, 8, meta=half)
    np.testing.assert_allclose(got_k.float().numpy(), want_k.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got_v.float().numpy(), want_v.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-3)
    assert got_k.dtype == torch.float16


def test_error_shrinks_with_bits_and_stays_within_half_a_level():
    generator = torch.Generator().manual_seed(5)
    keys, values = torch.randn(64, 32, generator=generator), torch.randn(64, 32, generator=generator)
    errors = []
    for bits in (2, 4, 8):
        got_k, got_v = quantize_head(keys, values, QuantSpec(bits=bits, group=32, residual=0))
        span = values.reshape(64, 1, 32).amax(-1) - values.reshape(64, 1, 32).amin(-1)
        assert bool(((got_v - values).abs() <= span / (2**bits - 1) / 2 + 1e-6).all())
        errors.append(float((got_k - keys).abs().mean()))
    assert errors[0] > errors[1] > errors[2] > 0


def test_head_bytes_count_packed_numbers_groups_and_residual():
    # 200 entries, d=64, 4 bits, group 32, residual 128, 2-byte elements: 72 quantized entries
    spec = QuantSpec(bits=4, group=32, residual=128)
    packed = 2 * 72 * 64 * 4 // 8
    key_groups = 64 * math.ceil(72 / 32)  # per channel, runs of 32 entries: 3 per channel
    value_groups = 72 * 2  # per entry, runs of 32 channels
    assert head_bytes(200, 64, 2, spec) == packed + 2 * 2 * (key_groups + value_groups) + 2 * 128 * 64 * 2
    assert head_bytes(100, 64, 2, spec) == 2 * 100 * 64 * 2  # all in the residual
    assert head_bytes(100, 64, 2, None) == 2 * 100 * 64 * 2
    sizes = [head_bytes(n, 64, 2, spec) for n in range(300)]
    assert all(b > a for a, b in zip(sizes, sizes[1:]))  # every entry kept costs bytes


@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (2, 8), (16, 2), (8, 16)])
@pytest.mark.parametrize("scheme", ["channel", "token"])
def test_keys_and_values_quantize_at_their_own_bits(key_bits, value_bits, scheme):
    """kbits/vbits: keys as the independent reading at key_bits, values at value_bits; 16 leaves a tensor as it was."""
    generator = torch.Generator().manual_seed(key_bits * 17 + value_bits)
    keys = torch.randn(70, 16, generator=generator) * torch.linspace(0.1, 5, 16)
    values = torch.randn(70, 16, generator=generator)
    spec = QuantSpec(key_axis=scheme, key_bits=key_bits, value_bits=value_bits, group=8, residual=10)
    assert spec.bits is None and spec.bits_text() == f"{key_bits}-bit keys and {value_bits}-bit values"
    got_k, got_v = quantize_head(keys, values, spec)
    for got, original, bits, tensor in ((got_k, keys, key_bits, 0), (got_v, values, value_bits, 1)):
        if bits == 16:
            assert torch.equal(got, original)
            continue
        want = naive_quantize(keys.numpy(), values.numpy(), bits, 8, 10, scheme == "channel")[tensor]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got[:60], original[:60])


@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (16, 4), (2, 16), (8, 8)])
def test_head_bytes_count_keys_and_values_at_their_own_bits(key_bits, value_bits):
    # 200 entries, d=64, group 32, residual 128, 2-byte elements: 72 quantized entries
    spec = QuantSpec(key_bits=key_bits, value_bits=value_bits, group=32, residual=128)

    def tensor(bits, groups):
        return 72 * 64 * 2 if bits == 16 else math.ceil(72 * 64 * bits / 8) + 2 * 2 * groups

    want = tensor(key_bits, 64 * math.ceil(72 / 32)) + tensor(value_bits, 72 * 2) + 2 * 128 * 64 * 2
    assert head_bytes(200, 64, 2, spec) == want
    assert (spec.bits == 8) == (key_bits == value_bits)
    assert QuantSpec(bits=4, group=32, residual=128) == QuantSpec(key_bits=4, value_bits=4, bits=None, group=32,
                                                                    residual=128)


@pytest.mark.parametrize("bad", [dict(bits=3), dict(group=0), dict(residual=-1), dict(key_axis="gptq"), dict(bits=True),
                                 dict(key_bits=3), dict(value_bits=True), dict(bits=None)])
def test_bad_quantizer_options_are_one_line(bad):
    with pytest.raises(UserError):
        QuantSpec(**bad)
