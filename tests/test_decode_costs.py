"""The decoding cost model's constants per device: the reference ones on a CPU, measured (once, kept) elsewhere or
when asked, and groups planned by them."""

import json
import math

import pytest
import torch

from ripplekv.engine import decode_costs
from ripplekv.engine.decode_costs import costs_for, measure, uses_measured
from ripplekv.engine.memory import REFERENCE_COSTS, DecodeCosts, plan_groups
from ripplekv.engine.prefill import prefill
from ripplekv.errors import UserError
from tests.conftest import tiny_llama


@pytest.fixture
def state_of_tiny():
    model = tiny_llama()
    return model, prefill(model, torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(1)))


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    """A fresh cache folder and no constants remembered in this process."""
    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path))
    monkeypatch.setattr(decode_costs, "_known", {})
    return tmp_path / decode_costs.FILE


def counting_measure(monkeypatch, costs: DecodeCosts) -> list:
    calls = []
    monkeypatch.setattr(decode_costs, "measure", lambda model, state: calls.append(1) or costs)
    return calls


def test_which_devices_measure():
    assert not uses_measured("cpu") and uses_measured("cuda") and uses_measured("mps")
    assert uses_measured("cpu", "measured") and uses_measured("cpu", " Measured ")
    assert not uses_measured("cuda", "reference")
    with pytest.raises(UserError, match="RIPPLEKV_DECODE_COSTS must be one of reference, measured, got 'fast'"):
        uses_measured("cpu", "fast")


def test_a_cpu_plans_with_the_reference_constants_without_measuring(state_of_tiny, kept_in, monkeypatch):
    monkeypatch.delenv(decode_costs.SETTING, raising=False)
    calls = counting_measure(monkeypatch, DecodeCosts(1.0, 2.0, 3.0))
    assert costs_for(*state_of_tiny) == REFERENCE_COSTS
    assert not calls and not kept_in.exists()


def test_measured_once_then_read_from_the_cache_folder(state_of_tiny, kept_in, monkeypatch):
    monkeypatch.setenv(decode_costs.SETTING, "measured")
    made = DecodeCosts(12.5, 0.25, 1e-6)
    calls = counting_measure(monkeypatch, made)
    assert costs_for(*state_of_tiny) == made and costs_for(*state_of_tiny) == made
    assert len(calls) == 1
    entry, = json.loads(kept_in.read_text())
    assert entry.startswith("cpu (") and f"{state_of_tiny[1].num_layers} layers" in entry and "| float32 |" in entry
    monkeypatch.setattr(decode_costs, "_known", {})  # a new process reads the file
    assert costs_for(*state_of_tiny) == made and len(calls) == 1


@pytest.mark.parametrize("kept", [{"step_ms": -1.0, "variant_ms": 1.0, "entry_ms": 0.0},
                                  {"step_ms": "nan", "variant_ms": 1.0, "entry_ms": 0.0},
                                  {"step_ms": 1.0}, "broken", None])
def test_a_bad_kept_entry_is_measured_again(state_of_tiny, kept_in, monkeypatch, kept):
    monkeypatch.setenv(decode_costs.SETTING, "measured")
    entry = decode_costs._entry_name(*state_of_tiny)
    kept_in.write_text("{not json" if kept is None else json.dumps({entry: kept}))
    made = DecodeCosts(3.0, 0.5, 2e-5)
    calls = counting_measure(monkeypatch, made)
    assert costs_for(*state_of_tiny) == made and len(calls) == 1
    assert json.loads(kept_in.read_text())[entry] == {"step_ms": 3.0, "variant_ms": 0.5, "entry_ms": 2e-5}


def test_the_fit_recovers_a_linear_cost(state_of_tiny, monkeypatch):
    model, state = state_of_tiny
    step, variant, entry = 7.0, 0.75, 3e-4
    monkeypatch.setattr(decode_costs, "_step_ms",
                        lambda model, state, count, length, calls: step + count * (variant + entry * state.num_layers * length))
    got = measure(model, state)
    assert got.step_ms == pytest.approx(step) and got.variant_ms == pytest.approx(variant)
    assert got.entry_ms == pytest.approx(entry)
    # a fit below zero is clamped: a step never free, no negative part
    monkeypatch.setattr(decode_costs, "_step_ms", lambda model, state, count, length, calls: 5.0 - count)
    clamped = measure(model, state)
    assert clamped.step_ms == pytest.approx(5.0) and clamped.variant_ms == 0.0
    monkeypatch.setattr(decode_costs, "_step_ms", lambda model, state, count, length, calls: 3.0 * count - 2.0)
    clamped = measure(model, state)
    assert clamped.step_ms == 1e-3 and clamped.variant_ms == pytest.approx(3.0) and clamped.entry_ms >= 0


def test_measuring_times_real_decoding_steps(state_of_tiny):
    """On a real model: finite constants; the state's own cache and the process's random state are left as
    they were."""
    model, state = state_of_tiny
    keys = [k.clone() for k in state.keys]
    torch.manual_seed(7)
    drawn_before = torch.rand(3)
    torch.manual_seed(7)
    got = measure(model, state, lengths=(8, 64), batches=(1, 3), calls=2)
    assert all(math.isfinite(x) and x >= 0 for x in (got.step_ms, got.variant_ms, got.entry_ms)) and got.step_ms > 0
    assert all(torch.equal(a, b) for a, b in zip(keys, state.keys))
    assert torch.equal(torch.rand(3), drawn_before)  # the process's random state untouched


def test_groups_follow_the_constants():
    """Eight short and eight long variants: the reference CPU constants decode them apart (padding the short
    ones to the long ones' length costs more than a second forward), launch-bound GPU-like ones together."""
    lengths = [[64] * 30] * 8 + [[2048] * 30] * 8
    plan = lambda costs: plan_groups(lengths, [32] * 16, lambda size, padded: 0, 1, costs=costs)  # noqa: E731
    assert plan(REFERENCE_COSTS) == [list(range(8)), list(range(8, 16))]
    assert plan(DecodeCosts(step_ms=5.0, variant_ms=0.05, entry_ms=0.0)) == [list(range(16))]
