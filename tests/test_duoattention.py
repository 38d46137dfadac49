"""DuoAttention: the split of a budget between streaming and retrieval heads, what each head keeps, the gate
objective against an independent computation, the one-line refusals, and the fit's resume."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.duoattention.gates import write_gates
from ripplekv.methods.duoattention.method import head_counts
from ripplekv.methods.duoattention.objective import gate_loss, last_hidden, streaming_mask
from tests.conftest import tiny_llama

GATES = [[0.1, 0.9], [0.5, 0.3]]  # two layers x two KV heads; streaming order: (0,0), (1,1), (1,0), (0,1)


@pytest.mark.parametrize("budget, rounding, expected", [
    # share (100-50)/(100-10) = 0.556 of 4 heads -> 2 stream at 10; 2 retrieval heads share 200-20 = 90 each
    (50, "exact", [[10, 90], [90, 10]]),
    # share 0.667 -> 3 stream; the one retrieval head would get 130 > 100: it keeps 100, streaming heads 20 each
    (40, "exact", [[20, 100], [20, 20]]),
    (50, "kvpress", [[10, 100], [100, 10]]),
    (40, "kvpress", [[10, 100], [10, 10]]),
    # B below the window: every head keeps B (sinks + recent), kvpress streams every head at its window
    (8, "exact", [[8, 8], [8, 8]]),
    (8, "kvpress", [[10, 10], [10, 10]]),
    (100, "exact", [[100, 100], [100, 100]]),
])
def test_a_budget_splits_between_streaming_and_retrieval_heads_as_worked_by_hand(budget, rounding, expected):
    assert head_counts(np.asarray(GATES), budget, 100, 2, 8, rounding).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 5), heads=st.integers(1, 4), length=st.integers(2, 400), budget=st.integers(1, 400),
       sinks=st.integers(0, 8), recent=st.integers(1, 40), seed=st.integers(0, 5))
def test_the_split_against_an_independent_computation(layers, heads, length, budget, sinks, recent, seed):
    """Exact totals, and the streaming heads are the ones with the lowest gates, as many as kvpress's mapping
    gives, each keeping its window unless the retrieval heads are full (or the budget is below the window)."""
    gates = np.random.default_rng(seed).permutation(layers * heads).reshape(layers, heads) / (layers * heads)
    counts = head_counts(gates, budget, length, sinks, recent)
    window, total = sinks + recent, layers * heads
    assert counts.sum() == total * min(budget, length) and counts.max() <= length
    if budget >= length or budget < window or length <= window:
        assert (counts == min(budget, length)).all()
        return
    fraction = (length - budget) / (length - window)
    streams = min(int(math.floor(total * fraction + 0.5)), total)  # round half up, except exact halves (below)
    if abs(total * fraction - math.floor(total * fraction) - 0.5) < 1e-12:
        streams = round(total * fraction)
    order = sorted(range(total), key=lambda i: gates.reshape(-1)[i])
    streaming, retrieval = order[:streams], order[streams:]
    flat = counts.reshape(-1)
    if retrieval and all(flat[i] == length for i in retrieval) and streaming:
        assert max(flat[streaming]) - min(flat[streaming]) <= 1 and min(flat[streaming]) >= window
    elif streams < total:
        assert all(flat[i] == window for i in streaming)
        assert max(flat[retrieval]) - min(flat[retrieval]) <= 1 and min(flat[retrieval]) >= window
    else:
        assert max(flat) - min(flat) <= 1


def prefilled(length: int = 60):
    from ripplekv.engine.prefill import Requirements, prefill_for

    model = tiny_llama()
    ids = torch.randint(3, 100, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, prefill_for(model, ids, Requirements())


def test_streaming_heads_keep_their_sinks_and_recent_window_and_retrieval_heads_the_prompt(tmp_path):
    model, state = prefilled(60)
    layers, heads = state.num_layers, state.num_kv_heads
    gates = np.linspace(0, 1, layers * heads).reshape(layers, heads)
    path = write_gates(tmp_path / "g.json", gates.tolist(), 3, 9, {})
    method = make_method(f"duoattention:gates={path}:rounding=kvpress")
    kept = method.select(state, 30).numpy()
    share = (60 - 30) / (60 - 12)
    streams = round(layers * heads * share)
    for index in range(layers * heads):
        layer, head = divmod(index, heads)
        expected = (set(range(3)) | set(range(51, 60))) if index < streams else set(range(60))
        assert set(np.flatnonzero(kept[layer, head]).tolist()) == expected
    exact = make_method(f"duoattention:gates={path}").select(state, 30).numpy()
    assert exact.sum() == layers * heads * 30
    for layer in range(layers):  # every head keeps its first 3 entries and a contiguous most recent run
        for head in range(heads):
            positions = np.flatnonzero(exact[layer, head])
            assert positions[:3].tolist() == [0, 1, 2] and positions[3:].tolist() == list(range(60 - len(positions) + 3, 60))


def test_the_mask_of_a_streaming_head():
    mask = streaming_mask(4, 6, 1, 2)  # queries at positions 2..5 of 6 keys
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]]


def frozen_model():
    model = tiny_llama(num_hidden_layers=2).double()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def test_the_objective_is_zero_at_full_gates_and_the_streaming_model_at_zero_gates():
    """Gates of 1 are the full model (no distillation loss); gates of 0 are the model under the streaming mask,
    computed independently by transformers' own eager attention given that mask."""
    model = frozen_model()
    ids = torch.randint(3, 100, (24,), generator=torch.Generator().manual_seed(1))
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ones = torch.ones(layers, heads, dtype=torch.float64)
    loss, distill = gate_loss(model, ids, 5, ones, 2, 4, 0.1)
    assert float(distill) < 1e-20 and float(loss) == pytest.approx(0.1)
    model.set_attn_implementation("eager")
    allowed = streaming_mask(24, 24, 2, 4)
    additive = torch.zeros(1, 1, 24, 24, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        full = last_hidden(model, ids)
        streamed = model.model(input_ids=ids[None], attention_mask=additive, use_cache=False).last_hidden_state[0]
    zeros = torch.zeros(layers, heads, dtype=torch.float64)
    loss, distill = gate_loss(model, ids, 5, zeros, 2, 4, 0.1)
    expected = (streamed[-5:] - full[-5:]).pow(2).mean(-1).mean()
    assert float(expected) > 1e-6 and float(distill) == pytest.approx(float(expected), rel=1e-6)  # eager softmax: float32
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_the_gates_gradient_against_finite_differences():
    model = frozen_model()
    ids = torch.randint(3, 100, (20,), generator=torch.Generator().manual_seed(2))
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    gates = torch.rand(layers, heads, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.8 + 0.1
    gates.requires_grad_(True)
    loss, _ = gate_loss(model, ids, 4, gates, 2, 3, 0.05)
    loss.backward()
    step = 1e-3  # central differences: O(step^2) error; smaller steps meet float32 RMSNorm noise
    for index in np.ndindex(layers, heads):
        moved = [gates.detach().clone() for _ in range(2)]
        moved[0][index] += step
        moved[1][index] -= step
        plus, minus = (float(gate_loss(model, ids, 4, g, 2, 3, 0.05)[0]) for g in moved)
        assert gates.grad[index].item() == pytest.approx((plus - minus) / (2 * step), rel=1e-3)
    assert gates.grad.abs().max() > 0


def test_a_model_without_gates_is_refused_in_one_line_naming_the_fit(tmp_path):
    method = make_method("duoattention")
    with pytest.raises(UserError, match="ripplekv fit duoattention --model M --out DIR") as refused:
        method.check_fitted((4, 2, 64), bundled=False)
    assert "\n" not in str(refused.value)
    path = write_gates(tmp_path / "g.json", [[0.5, 0.5]] * 3, 2, 4, {})
    with pytest.raises(UserError, match="was fitted for 3 layers x 2 KV heads; the model has 4 layers x 2 KV heads"):
        make_method(f"duoattention:gates={path}").check_fitted((4, 2, 64), bundled=False)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(UserError, match="not written by ripplekv fit duoattention"):
        make_method(f"duoattention:gates={tmp_path / 'bad.json'}")
    with pytest.raises(UserError, match="option rounding must be one of exact, kvpress"):
        make_method(f"duoattention:gates={path}:rounding=up")
    with pytest.raises(UserError, match="budgets differ by head"):
        make_method(f"duoattention:gates={path}").layer_budgets(3, 64, 100)


def test_the_bundled_model_reads_the_shipped_gates():
    from ripplekv.methods.duoattention.gates import read_gates, shipped_gates

    shipped = read_gates(shipped_gates())
    assert np.asarray(shipped["gates"]).shape == (30, 3)
    assert shipped["provenance"]["steps_done"] >= 1 and "final_loss" in shipped["provenance"]
    make_method("duoattention").check_fitted((30, 3, 576), bundled=True)


def fit(out: Path, model_dir, steps: int = 3, interrupt_at: int | None = None):
    from ripplekv.pipeline.duoattention_fit import DEFAULT_TASKS, GateSettings, fit_gates
    from ripplekv.pipeline.model_choice import ModelChoice
    from ripplekv.tasks.calibration import Calibration

    def bar(total, done):
        def advance(step):  # called once a step is checkpointed: a kill right after it
            if step == interrupt_at:
                raise KeyboardInterrupt

        return nullcontext(), advance

    calibration = Calibration(2, 256, with_answer=True, tasks=DEFAULT_TASKS)
    return fit_gates(out, ModelChoice(str(model_dir), "cpu", "float32"), GateSettings(steps, 2, 8, 0.05, 0.02),
                     calibration, bar=bar)


def test_a_killed_fit_resumes_to_the_same_gates_and_other_settings_are_refused(tmp_path, tiny_model_dir):
    whole, info = fit(tmp_path / "whole", tiny_model_dir)
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path / "killed", tiny_model_dir, interrupt_at=0)
    partial = json.loads((tmp_path / "killed" / "duoattention-gates.json").read_text())
    assert partial["provenance"]["steps_done"] == 1
    resumed, resumed_info = fit(tmp_path / "killed", tiny_model_dir)
    assert json.loads(resumed.read_text())["gates"] == json.loads(whole.read_text())["gates"]
    assert [h["loss"] for h in resumed_info["history"]] == [h["loss"] for h in info["history"]]
    assert info["steps_done"] == 3 and info["final_loss"] == info["history"][-1]["loss"]
    gates = np.asarray(json.loads(whole.read_text())["gates"])
    assert gates.min() >= 0 and gates.max() <= 1 and gates.min() < 1  # the L1 penalty moved them
    with pytest.raises(UserError, match="holds a fit of other settings .differs in: steps"):
        fit(tmp_path / "whole", tiny_model_dir, steps=4)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps and --recent must be at least 1 and --sinks at least 0, got 0"),
    (["--l1", "-1"], "--l1 must be at least 0 and --lr above 0"),
    (["--target-tokens", "10"], "--target-tokens must be"),
])
def test_the_fit_command_refuses_a_mistake_in_one_line(tmp_path, args, message):
    from tests.conftest import invoke

    done = invoke("fit", "duoattention", "--out", tmp_path / "out", *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_kvpress_is_given_the_shipped_gates_order_with_ties_broken_as_ours(tmp_path, monkeypatch):
    """check-references hands DuoAttentionPress distinct values in our order: its argsort (which leaves ties
    unspecified) then streams the same heads as ours at every count, though two shipped gates tie at 1."""
    from ripplekv.methods.duoattention.gates import read_gates, shipped_gates
    from ripplekv.methods.duoattention.method import streaming_heads
    from tests.conftest import load_script

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    learned = load_script("check_references_learned")
    assert learned.shipped_duo_gates(tmp_path) == ["duoattention:rounding=kvpress"]
    pattern = json.loads((tmp_path / learned.DUO_FILE).read_text())
    order = np.asarray(pattern["order"])
    gates = np.asarray(read_gates(shipped_gates())["gates"])
    assert len(set(gates.ravel().tolist())) < gates.size and len(set(order.ravel().tolist())) == order.size
    assert 0 < order.min() and order.max() < 1 and (pattern["sinks"], pattern["recent"]) == (16, 64)
    for budget in range(81, 1000, 7):  # every streaming count from 1 to 90 on a 1000-token prompt
        ours = streaming_heads(gates, budget, 1000, 80)
        theirs = np.zeros(gates.size, dtype=bool)
        theirs[np.argsort(order, axis=None)[: int(ours.sum())]] = True
        assert (theirs.reshape(gates.shape) == ours).all()
