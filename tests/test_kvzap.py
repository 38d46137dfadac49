"""KVzap: the surrogate's fit recovers a known target, its weights file, the recorded hidden states, exact budgets."""

from __future__ import annotations

import json

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.kvzap import surrogate as kvzap_surrogate
from ripplekv.methods.kvzap.method import HIDDEN_STATES
from tests.conftest import tiny_llama
from tests.test_lukv import tiny_curve


def linear_problem(dim: int, heads: int, rows: int, seed: int, noise: float = 0.01):
    """Inputs with a few large channels (as attention inputs have), targets linear in them around -8 (log scores)."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.ones(dim)
    scale[:3] = 6.0
    weight = torch.randn(heads, dim, generator=generator) / dim**0.5
    bias = torch.tensor([-8.0, -6.5, -10.0][:heads])

    def draw(count, offset):
        x = torch.randn(count, dim, generator=torch.Generator().manual_seed(seed + offset)) * scale
        return x, x @ weight.T + bias + noise * torch.randn(count, heads, generator=generator)

    return weight, bias, draw(rows, 1), draw(rows // 4, 2)


def r_squared(predicted: torch.Tensor, truth: torch.Tensor) -> float:
    return float(1 - ((predicted - truth) ** 2).sum() / ((truth - truth.mean(0)) ** 2).sum())


def test_the_linear_fit_recovers_a_known_linear_target():
    weight, bias, (x, y), (test_x, test_y) = linear_problem(dim=24, heads=3, rows=3000, seed=0)
    fitted = kvzap_surrogate.fit_linear(x, y)
    assert torch.allclose(fitted.weight.detach(), weight, atol=2e-3)
    assert torch.allclose(fitted.bias.detach(), bias, atol=2e-3)
    assert r_squared(kvzap_surrogate.predict(fitted, test_x).T, test_y) > 0.999
    # the fit is of these targets, not any: shuffled targets leave nothing to recover
    shuffled = kvzap_surrogate.fit_linear(x, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(1))])
    assert r_squared(kvzap_surrogate.predict(shuffled, test_x).T, test_y) < 0.05


def test_the_mlp_fit_learns_a_known_linear_target_on_held_out_inputs():
    _, _, (x, y), (test_x, test_y) = linear_problem(dim=64, heads=2, rows=2000, seed=3)
    mlp = kvzap_surrogate.fit_mlp(x, y, epochs=20)
    assert [type(m).__name__ for m in mlp] == ["Linear", "GELU", "Linear"] and mlp[0].out_features == 64 // 8
    assert r_squared(kvzap_surrogate.predict(mlp, test_x).T, test_y) > 0.9
    once, again = (kvzap_surrogate.fit_mlp(x[:600], y[:600], epochs=2) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(once.state_dict().values(), again.state_dict().values()))  # seeded


def tiny_weights(tmp_path, kind="mlp", layers=4, heads=2, dim=64, seed=0):
    torch.manual_seed(seed)
    return kvzap_surrogate.save(tmp_path / f"kvzap-{kind}-{layers}.safetensors", kind,
                                kvzap_surrogate.build(kind, dim, heads, layers), {"model": "tiny"})


def test_weights_round_trip_under_kvpress_names_and_a_bad_file_is_one_line(tmp_path):
    from safetensors.torch import load_file

    path = tiny_weights(tmp_path)
    names = set(load_file(str(path)))
    assert {"layers.0.0.weight", "layers.0.0.bias", "layers.3.2.weight", "layers.3.2.bias"} <= names
    layers, info = kvzap_surrogate.load(path)
    assert (info["surrogate"], info["input_dim"], info["hidden_dim"], info["output_dim"], info["n_modules"]) == ("mlp", 64, 8, 2, 4)
    linear = tiny_weights(tmp_path, "linear")
    assert set(load_file(str(linear))) == {f"layers.{i}.{p}" for i in range(4) for p in ("weight", "bias")}
    path.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="do not load"):
        kvzap_surrogate.load(path)
    with pytest.raises(UserError, match="do not exist"):
        make_method(f"kvzap:weights={tmp_path / 'missing.safetensors'}")
    with pytest.raises(UserError, match="hold a linear surrogate"):
        make_method(f"kvzap:weights={linear}")


def test_hidden_states_are_each_layers_normed_attention_input_and_change_nothing_else():
    model = tiny_llama()
    ids = torch.randint(0, 101, (90,), generator=torch.Generator().manual_seed(0))
    plain = prefill_for(model, ids, Requirements())
    state = prefill_for(model, ids, Requirements(signals={HIDDEN_STATES}))
    with torch.no_grad():
        outputs = model(ids[None], output_hidden_states=True)
    for layer, block in enumerate(model.model.layers):
        expected = block.input_layernorm(outputs.hidden_states[layer])[0]
        assert torch.allclose(state.signal("hidden_states")[layer], expected, atol=1e-5)
        assert torch.equal(state.keys[layer], plain.keys[layer]) and torch.equal(state.values[layer], plain.values[layer])
    assert "hidden_states" not in plain.signals


def test_kvzap_keeps_snapkvs_total_by_its_surrogates_scores(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 101, (300,), generator=torch.Generator().manual_seed(0))
    weights = tiny_weights(tmp_path)
    methods = [make_method(s) for s in ("snapkv", f"kvzap:weights={weights}", f"kvzap:weights={weights}:window=0")]
    state = prefill_for(model, ids, Requirements.of_all(methods))
    layers, _ = kvzap_surrogate.load(weights)
    for budget in (40, 128):
        assert [int(m.select(state, budget).sum()) for m in methods] == [4 * 2 * budget] * 3
        kept = methods[2].select(state, budget)
        for layer in range(4):
            with torch.no_grad():  # the loaded surrogate on the recorded inputs, by hand
                scores = layers[layer](state.signal("hidden_states")[layer].clone()).T  # [H, n]
            for head in range(2):
                top = set(torch.argsort(scores[head], descending=True, stable=True)[:budget].tolist())
                assert set(torch.nonzero(kept[layer, head]).flatten().tolist()) == top
        assert methods[1].select(state, budget)[..., -32:].all()  # the window is kept
    assert make_method(f"kvzap:weights={weights}").label == f"kvzap:weights={weights.name}"
    with pytest.raises(UserError, match="was fitted for 3 layers"):
        make_method(f"kvzap:weights={tiny_weights(tmp_path, layers=3)}").select(state, 40)
    with pytest.raises(UserError, match="kvzap needs a fitted mlp surrogate"):
        make_method("kvzap").select(state, 40)


@pytest.mark.slow
def test_eval_keeps_as_many_entries_for_kvzap_and_lukv_as_for_snapkv(tiny_model_dir, tmp_path, run_cli):
    """`ripplekv eval --budget 40 --methods full,snapkv,lukv,kvzap` on a tiny model: exactly SnapKV's kept total."""
    curve = tiny_curve(tmp_path, "lukv", layers=4, heads=2)
    weights = tiny_weights(tmp_path, dim=32)
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", f"full,snapkv,lukv:curve={curve},kvzap:weights={weights}",
                           "--budget", "40", "--out", str(out))
    assert code == 0, err
    rows = {r["method"]: r for r in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    assert rows[f"kvzap:weights={weights.name}"]["kept_entries"] == rows["snapkv"]["kept_entries"] == 4 * 2 * 40
    assert rows[f"lukv:curve={curve.name}"]["kept_entries"] == 4 * 2 * 40


def test_the_shipped_surrogates_are_where_kvzap_looks():
    """The bundled model's surrogates ship in ripplekv/data/kvzap: kvzap finds them wherever its module sits (a move
    into methods/kvzap/ once left it looking in methods/data/)."""
    from ripplekv.methods.kvzap.method import SHIPPED

    assert {"smollm2-135m-linear.safetensors", "smollm2-135m-mlp.safetensors"} <= {p.name for p in SHIPPED.iterdir()}
