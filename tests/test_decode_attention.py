"""Decoding attention (engine.decode_attention): the fused SDPA path is our attention within float tolerance,
every bias folded into its mask; layers with overrides stay ours; a device's path is measured once and kept."""

import json

import pytest
import torch

from ripplekv.engine import decode_attention
from ripplekv.engine.cache import CompressedLayer, VariantOverride
from ripplekv.engine.decode import greedy_decode
from ripplekv.engine.decode_attention import compressed_attention, fused_attention, our_attention
from ripplekv.engine.prefill import prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method

HEADS, GROUP, DIM = 2, 3, 8


def layer_of(kind: str, dtype=torch.float32, variants: int = 3, kept: int = 12, decoded: int = 5, new_len: int = 1):
    """A compressed layer of one of the shapes decoding meets, its last `new_len` decoded tokens as the step's."""
    gen = torch.Generator().manual_seed(hash(kind) % 1000)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    shared = kind == "shared"
    rows = 1 if shared else variants
    bias = None
    if kind in ("padded", "hidden", "window"):
        bias = torch.zeros(rows, HEADS, kept)
        bias[1, 0, kept - 4 :] = float("-inf")  # padding
        bias[2, 1, :3] = torch.tensor([0.7, 1.1, 0.0])  # log-weights of merged entries
    layer = CompressedLayer(draw(rows, HEADS, kept, DIM), draw(rows, HEADS, kept, DIM), bias, original_length=40)
    if kind == "window":
        positions = torch.arange(40 - kept, 40).repeat(rows, HEADS, 1)
        positions[0, 1, :4] = torch.tensor([2, 5, 7, 30])
        layer.slide(7, positions)
    layer.update(draw(variants, HEADS, decoded, DIM), draw(variants, HEADS, decoded, DIM))
    if kind == "hidden":
        layer.hidden = torch.zeros(variants, 3)
        layer.hidden[1, 1:] = float("-inf")  # forced tokens variant 1 did not produce
        layer.decoded_bias = torch.zeros(variants, HEADS, decoded)
        layer.decoded_bias[2, 0, 0] = float("-inf")  # evicted under a decode budget
    query = draw(variants, HEADS * GROUP, new_len, DIM)
    return layer, query


@pytest.mark.parametrize("kind", ["shared", "padded", "window", "hidden"])
@pytest.mark.parametrize("new_len", [1, 3])
def test_the_fused_path_is_our_attention(kind, new_len):
    layer, query = layer_of(kind, new_len=new_len)
    ours = our_attention(query, layer, layer.keys, layer.values, DIM**-0.5)
    fused = fused_attention(query, layer, layer.keys, layer.values, DIM**-0.5)
    assert fused.shape == ours.shape == (3, new_len, HEADS * GROUP, DIM) and fused.is_contiguous()
    assert torch.allclose(fused, ours, atol=1e-5, rtol=1e-5)


def test_in_bfloat16_it_computes_in_float32_and_returns_bfloat16():
    layer, query = layer_of("padded", dtype=torch.bfloat16)
    fused = fused_attention(query, layer, layer.keys, layer.values, DIM**-0.5)
    ours = our_attention(query, layer, layer.keys, layer.values, DIM**-0.5)
    assert fused.dtype == torch.bfloat16
    assert torch.allclose(fused.float(), ours.float(), atol=3e-2)


def test_layers_with_an_override_or_an_evictor_stay_on_our_path(monkeypatch):
    monkeypatch.setenv("RIPPLEKV_DECODE_ATTENTION", "fused")
    monkeypatch.setattr(decode_attention, "_chosen", {})
    layer, query = layer_of("shared")
    assert decode_attention.takes_fused(layer, query)
    layer.override = VariantOverride(1, value_delta=torch.randn(HEADS, 12, DIM))
    assert not decode_attention.takes_fused(layer, query)
    ours = our_attention(query, layer, layer.keys, layer.values, DIM**-0.5)
    assert torch.equal(compressed_attention(query, layer, layer.keys, layer.values, DIM**-0.5), ours)


def test_a_device_measures_once_and_keeps_its_path(monkeypatch, tmp_path):
    monkeypatch.delenv("RIPPLEKV_DECODE_ATTENTION", raising=False)
    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path))
    measured = []

    def calibrate(*args):
        measured.append(args)
        return {"path": "fused", "ours_ms": 1.0, "fused_ms": 0.5}

    monkeypatch.setattr(decode_attention, "calibrate", calibrate)
    cpu = torch.device("cpu")
    assert decode_attention.device_path(cpu, torch.float32, 2, 3, 8, CompressedLayer) == "fused"
    # read back, not measured again
    assert decode_attention.device_path(cpu, torch.float32, 2, 3, 8, CompressedLayer) == "fused"
    assert len(measured) == 1
    kept = json.loads((tmp_path / decode_attention.FILE).read_text())
    assert [entry["path"] for entry in kept.values()] == ["fused"] and "2x3x8" in next(iter(kept))
    decode_attention.device_path(cpu, torch.float32, 1, 4, 16, CompressedLayer)  # another shape is measured on its own
    (tmp_path / decode_attention.FILE).write_text("{not json")  # a broken file is measured again
    decode_attention.device_path(cpu, torch.float32, 2, 3, 8, CompressedLayer)
    assert len(measured) == 3


def test_a_bad_setting_is_one_line(monkeypatch):
    monkeypatch.setenv("RIPPLEKV_DECODE_ATTENTION", "flash")
    with pytest.raises(UserError, match="RIPPLEKV_DECODE_ATTENTION must be one of ours, fused, got 'flash'"):
        decode_attention.device_path(torch.device("cpu"), torch.float32, 2, 3, 8, CompressedLayer)


def test_calibration_times_both_paths_and_keeps_ours_unless_fused_is_clearly_faster():
    result = decode_attention.calibrate(torch.device("cpu"), torch.float32, 2, 3, 8, CompressedLayer,
                                        decode_attention.Trial(variants=4, kept=32, rounds=2, calls=2))
    assert result["ours_ms"] > 0 and result["fused_ms"] > 0
    faster = result["fused_ms"] <= decode_attention.MARGIN * result["ours_ms"]
    assert result["path"] == ("fused" if faster else "ours")


def test_greedy_answers_are_the_same_on_either_path(tiny_model, monkeypatch):
    state = prefill(tiny_model, torch.arange(3, 60))
    variants = [make_method(name).compress(state, 16) for name in ("snapkv", "streamingllm", "tova")]
    answers = {}
    for path in decode_attention.PATHS:
        monkeypatch.setenv("RIPPLEKV_DECODE_ATTENTION", path)
        monkeypatch.setattr(decode_attention, "_chosen", {})
        answers[path] = greedy_decode(tiny_model, state, variants, 8)
    assert answers["fused"] == answers["ours"]


def test_the_first_decoding_step_measures_the_device(tiny_model, monkeypatch, tmp_path):
    monkeypatch.delenv("RIPPLEKV_DECODE_ATTENTION", raising=False)
    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path))
    monkeypatch.setattr(decode_attention, "_chosen", {})
    state = prefill(tiny_model, torch.arange(3, 40))
    greedy_decode(tiny_model, state, [make_method("snapkv").compress(state, 16)], 2)
    (entry,) = json.loads((tmp_path / decode_attention.FILE).read_text()).values()
    assert entry["path"] in decode_attention.PATHS and entry["ours_ms"] > 0 and entry["fused_ms"] > 0
