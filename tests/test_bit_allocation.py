"""Bits per layer from the sensitivity profile (`bits=profile`): the greedy, its specs and its mistakes."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.quantize import BITS
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.bit_allocation import UPGRADE, BitProfile, greedy_bits
from ripplekv.methods.core.spec import options_taken
from tests.conftest import tiny_llama


def write_profile(path, sensitivity) -> str:
    path.write_text("layer,sensitivity,multiplier\n" + "".join(f"{layer},{s},1\n" for layer, s in enumerate(sensitivity)))
    return str(path)


def test_the_greedy_matches_a_hand_worked_three_layer_example():
    """s = (1, 100, 0), 4 bits on average (12 in all; 6 spent at 2 bits). Predicted-loss drop per extra bit:
    layer 1 from 2 to 4 bits, 100 x (4^-2 - 4^-4) / 2 = 2.93, beats layer 0's 0.029 (12 bits left: 8 spent);
    then layer 1 from 4 to 8, 100 x (4^-4 - 4^-8) / 4 = 0.097, still beats layer 0's 0.029: 12 spent, none fits."""
    assert BitProfile("a.csv", (1.0, 100.0, 0.0), 4.0).bits_for_average(3) == [2, 8, 2]
    # in bytes: each layer costs 10 at 2 bits, 14 at 4, 22 at 8, 30 at 16; 50 to spend (30 at 2 bits). Layer 1 to
    # 4 (34) and 8 (42); its 8 -> 16 (cost 8, drop 100 x 4^-8 / 8 ~ 2e-4) loses to layer 0's 2 -> 4 (cost 4, drop
    # 0.015 per unit: 46); then only layer 2's 2 -> 4 (drop 0, cost 4) fits: 50, and nothing more does
    costs = {2: 10, 4: 14, 8: 22, 16: 30}
    assert greedy_bits((1.0, 100.0, 0.0), lambda layer, bits: costs[bits], 50) == [4, 8, 4]
    assert greedy_bits((1.0, 100.0, 0.0), lambda layer, bits: costs[bits], 29) is None  # 2 bits everywhere: 30


@pytest.mark.parametrize("average", [2.0, 3.0, 4.0, 6.5, 16.0])
def test_more_sensitive_layers_get_more_bits_within_the_average(average):
    sensitivity = (3e-4, 2e-2, 0.0, 5e-3, 1e-4, 7e-2)
    bits = BitProfile("a.csv", sensitivity, average).bits_for_average(6)
    order = sorted(range(6), key=lambda layer: sensitivity[layer])
    assert [bits[layer] for layer in order] == sorted(bits[layer] for layer in order)  # rises with sensitivity
    assert sum(bits) <= average * 6
    for width in bits:  # spent: no single upgrade fits any more
        assert width == 16 or sum(bits) - width + UPGRADE[width] > average * 6
    if average == 2.0:
        assert bits == [2] * 6
    if average == 16.0:
        assert bits == [16] * 6


def predicted(sensitivity, bits) -> float:
    return sum(s * 4.0 ** -b for s, b in zip(sensitivity, bits))


def test_the_greedy_never_predicts_more_loss_than_uniform_bits_at_the_same_average():
    """The profile's bits against the uniform ones they replace (kivi:bits=4 is 4 bits everywhere), on random
    profiles; and one case showing the greedy is not exact (a knapsack greedy): s = (0.001, 1, 10) with 26 bits
    to spend ends at (8, 8, 8), where (2, 8, 16) would predict half the loss."""
    generator = np.random.default_rng(0)
    for _ in range(200):
        layers = int(generator.integers(2, 9))
        sensitivity = tuple(10.0 ** generator.uniform(-6, 0, layers))
        for width in BITS:
            chosen = greedy_bits(sensitivity, lambda layer, bits: bits, width * layers)
            assert predicted(sensitivity, chosen) <= predicted(sensitivity, [width] * layers) * (1 + 1e-12)
    chosen = greedy_bits((0.001, 1.0, 10.0), lambda layer, bits: bits, 26)
    assert chosen == [8, 8, 8]
    best = min(itertools.product(BITS, repeat=3), key=lambda bits: predicted((0.001, 1.0, 10.0), bits)
               if sum(bits) <= 26 else float("inf"))
    assert best == (2, 8, 16) and predicted((0.001, 1.0, 10.0), best) < predicted((0.001, 1.0, 10.0), chosen) / 2


def test_bits_profile_specs_read_the_allocation_and_say_so(tmp_path):
    path = write_profile(tmp_path / "alloc.csv", (0.1, 0.4, 0.2, 0.3))
    alone = make_method(f"kivi:bits=profile:allocation={path}")  # as calibration draws write it
    assert alone.label == "kivi:allocation=alloc.csv:bits=profile" and alone.profile.average_bits is None
    described = alone.describe()["quantizer"]
    assert described["bits"] == "profile" and described["sensitivity"] == [0.1, 0.4, 0.2, 0.3]
    assert described["allocation"] == path and "avgbits" not in described
    joint = make_method("ripplekv:quant=kivi:bits=profile:avgbits=5", shared={"allocation": path})
    assert joint.label == "ripplekv:quant=kivi:avgbits=5:bits=profile" and joint.profile.average_bits == 5
    assert joint.describe()["allocator"]["allocation"] == path  # entries and bits from the same file
    assert make_method("snapkv:quant=kivi:bits=profile", shared={"allocation": path}).profile.average_bits == 4
    assert "allocation" in options_taken(["kivi:bits=profile", "snapkv:quant=token:bits=profile"])
    assert "allocation" not in options_taken(["kivi:bits=4", "snapkv:quant=kivi:kbits=4:vbits=2"])
    split = make_method("kivi:kbits=4:vbits=2")
    assert split.label == "kivi:kbits=4:vbits=2" and (split.quantizer.key_bits, split.quantizer.value_bits) == (4, 2)
    assert json.loads(json.dumps(split.describe()))["quantizer"] == {"key_axis": "channel", "group": 32, "residual": 128,
                                                                     "key_bits": 4, "value_bits": 2}
    assert make_method("kivi:bits=4").describe()["quantizer"] == {"key_axis": "channel", "bits": 4, "group": 32,
                                                                 "residual": 128}  # as before kbits/vbits


@pytest.mark.parametrize("spec,message", [
    ("kivi:bits=profile", "bits=profile reads each layer's sensitivity from an allocation file and none was given"),
    ("kivi:bits=4:kbits=8", "give bits (keys and values) or kbits/vbits, not both"),
    ("kivi:kbits=16:vbits=16", "is no quantizer"),
    ("kivi:kbits=3", "option kbits must be one of 2, 4, 8, 16, got 3"),
    ("kivi:bits=3", "option bits must be one of 2, 4, 8, got 3"),  # the choices it offers are the ones it takes
    ("kivi:bits=16", "option bits must be one of 2, 4, 8, got 16"),
    ("snapkv:quant=kivi:bits=4:avgbits=3", "avgbits sets the average bits of bits=profile"),
    ("snapkv:avgbits=3", "needs a quantizer"),
    ("snapkv:quant=kivi:bits=profile:avgbits=1", "avgbits must be between 2 and 16"),
    ("snapkv:quant=kivi:bits=profile:kbits=4", "drop kbits/vbits"),
])
def test_mistakes_in_bits_options_are_one_line(tmp_path, spec, message):
    shared = {} if spec == "kivi:bits=profile" else {"allocation": write_profile(tmp_path / "a.csv", (1, 2, 3, 4))}
    with pytest.raises(UserError, match=re.escape(message)) as caught:
        make_method(spec, shared=shared)
    assert "\n" not in str(caught.value)


def test_a_profile_of_another_model_is_refused(tmp_path):
    state = prefill_for(tiny_llama(), torch.arange(40) % 97 + 3, Requirements(capture_window=32))
    method = make_method("kivi:bits=profile", shared={"allocation": write_profile(tmp_path / "a.csv", (1, 2, 3))})
    with pytest.raises(UserError, match="allocation has 3 layers but the model has 4"):
        method.infeasible(state, 64)


def test_eval_without_any_allocation_says_so_in_one_line(tiny_model_dir, tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/allocate/allocation.csv here, and the model is not the bundled one
    code, out, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit",
                             "1", "--methods", "kivi:bits=profile", "--budget", "64", "--out", str(tmp_path / "run"))
    assert code == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "bits=profile" in err and "--allocation" in err and not (tmp_path / "run").exists()


def test_methods_lists_the_quantizer_options(run_cli):
    code, out, _ = run_cli("methods")
    assert code == 0
    assert all(word in out for word in ("kbits=", "vbits=", "bits=profile", "avgbits=4", "residual=128"))


def test_the_worked_example_of_docs_methods():
    """docs/methods.md's bytes: 3 layers, s = (1, 100, 0), d = 64 at 2 bytes, 1,000 entries per head, B = 512."""
    from ripplekv.engine.quantize import QuantSpec, head_bytes

    per_layer = {bits: head_bytes(1000, 64, 2, QuantSpec(bits=bits)) for bits in BITS}
    assert per_layer == {2: 74_816, 4: 102_720, 8: 158_528, 16: 256_000}
    budget = 3 * 512 * 2 * 64 * 2
    assert budget == 393_216
    chosen = greedy_bits((1.0, 100.0, 0.0), lambda layer, bits: per_layer[bits], budget)
    assert chosen == [8, 8, 2] and sum(per_layer[bits] for bits in chosen) == 391_872
    assert head_bytes(1000, 64, 2, QuantSpec(key_bits=4, value_bits=2)) == 88_768
