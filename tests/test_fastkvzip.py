"""FastKVzip: the gate's formula and its fit against independent computations, the weights file, exact budgets, the
one-line refusals, and `ripplekv fit fastkvzip` (resumable)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.fastkvzip import gate as fastkvzip_gate
from tests.conftest import invoke as run
from tests.conftest import tiny_llama


def formula(p: dict, hidden: torch.Tensor, heads: int, group: int, dim: int = 16) -> torch.Tensor:
    """The gate's formula written out on parameters `p`: per KV head h and query g, sigmoid(own logit - logsumexp of
    the learned sinks' logits), the own logit q.k / sqrt(d) + b over RMS-normed q, k; a head's score the mean over its
    queries. Scores [H, n] in float64."""
    x = hidden.double()

    def rms(v, weight):
        return weight * v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6)

    q = rms((x @ p["q_proj.weight"].T + p["q_proj.bias"]).reshape(-1, heads, group, dim), p["q_norm.weight"])
    k = rms((x @ p["k_proj.weight"].T).reshape(-1, heads, dim), p["k_norm.weight"])
    own = torch.einsum("nhd,nhgd->nhg", k, q) / math.sqrt(dim) + p["b"][:, 0, :]
    sinks = torch.einsum("hsd,nhgd->nhsg", p["k_base"][:, 0], q) / math.sqrt(dim)
    return torch.sigmoid(own - torch.logsumexp(sinks, dim=2)).mean(-1).T


def by_hand(gate, hidden: torch.Tensor) -> torch.Tensor:
    return formula({k: v.detach().double() for k, v in gate.state_dict().items()}, hidden, gate.heads, gate.group)


def random_gate(dim=24, heads=2, group=3, seed=0) -> fastkvzip_gate.Gate:
    """A gate whose sinks, biases and norm scales are not at their initial values (0, 0, 1)."""
    gate = fastkvzip_gate.initial(dim, heads, group, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        gate.k_base.copy_(torch.randn(gate.k_base.shape, generator=generator))
        gate.b.copy_(torch.randn(gate.b.shape, generator=generator))
        gate.q_norm.weight.copy_(1 + 0.3 * torch.randn(gate.q_norm.weight.shape, generator=generator))
        gate.k_norm.weight.copy_(1 + 0.3 * torch.randn(gate.k_norm.weight.shape, generator=generator))
    return gate


def test_the_gate_scores_by_its_formula():
    gate = random_gate()
    hidden = torch.randn(50, 24, generator=torch.Generator().manual_seed(1)) * 3
    scores = fastkvzip_gate.predict(gate, hidden)
    assert scores.shape == (2, 50) and bool(((scores > 0) & (scores < 1)).all())
    assert torch.allclose(scores.double(), by_hand(gate, hidden), atol=1e-6)
    shapes = {name: tuple(v.shape) for name, v in gate.state_dict().items()}  # kvpress's FastKVzipGate names and shapes
    assert shapes == {"q_proj.weight": (2 * 3 * 16, 24), "q_proj.bias": (2 * 3 * 16,), "k_proj.weight": (2 * 16, 24),
                      "q_norm.weight": (16,), "k_norm.weight": (16,), "k_base": (2, 1, 16, 16), "b": (2, 1, 3)}


def test_two_fit_steps_are_sgd_with_momentum_on_the_cross_entropy_by_hand():
    """Two full-batch steps: the first at the full rate, the second (from half the steps) at half, momentum 0.9."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(40, 24, generator=generator) * 2
    y = torch.rand(40, 2, generator=generator) ** 4  # KVzip-like: most scores near 0
    fitted = fastkvzip_gate.fit_gate(x, y, group=3, steps=2, lr=0.2, batch=40, seed=5)
    start = fastkvzip_gate.initial(24, 2, 3, seed=5)
    params = {k: v.detach().double() for k, v in start.state_dict().items()}

    def gradient(at):
        at = {k: v.clone().requires_grad_(True) for k, v in at.items()}
        predicted, target = formula(at, x, 2, 3), y.double().T
        loss = -(target * torch.log(predicted) + (1 - target) * torch.log(1 - predicted)).mean(-1).sum()
        loss.backward()
        return {k: v.grad for k, v in at.items()}

    first = gradient(params)
    middle = {k: params[k] - 0.2 * first[k] for k in params}
    second = gradient(middle)
    expected = {k: middle[k] - 0.2 * 0.5 * (0.9 * first[k] + second[k]) for k in params}
    for name, value in fitted.state_dict().items():
        assert torch.allclose(value.double(), expected[name], atol=1e-5), name
    assert not torch.allclose(fitted.q_proj.weight.double(), params["q_proj.weight"], atol=1e-4)  # it moved


def test_the_fit_learns_a_known_gate_on_held_out_inputs():
    from scipy.stats import spearmanr

    teacher = random_gate(seed=3)
    generator = torch.Generator().manual_seed(4)
    x, test_x = torch.randn(3000, 24, generator=generator), torch.randn(500, 24, generator=generator)
    y = fastkvzip_gate.predict(teacher, x).T
    student = fastkvzip_gate.fit_gate(x, y, group=3, steps=600, batch=500, seed=0)
    truth, guess = fastkvzip_gate.predict(teacher, test_x), fastkvzip_gate.predict(student, test_x)
    untrained = fastkvzip_gate.predict(fastkvzip_gate.initial(24, 2, 3, 0), test_x)
    for head in range(2):
        learned = spearmanr(guess[head], truth[head]).statistic
        assert learned > 0.7 and learned > abs(spearmanr(untrained[head], truth[head]).statistic) + 0.3
    again = fastkvzip_gate.fit_gate(x[:800], y[:800], group=3, steps=5, batch=500, seed=0)
    once = fastkvzip_gate.fit_gate(x[:800], y[:800], group=3, steps=5, batch=500, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(once.state_dict().values(), again.state_dict().values()))  # seeded


def tiny_gates(tmp_path, layers=4, heads=2, dim=64, group=2, name="gates"):
    return fastkvzip_gate.save(tmp_path / f"{name}.safetensors",
                               [random_gate(dim, heads, group, seed=i) for i in range(layers)], {"model": "tiny"})


def test_gates_round_trip_under_the_press_names_and_a_bad_file_is_one_line(tmp_path):
    from safetensors.torch import load_file

    path = tiny_gates(tmp_path)
    assert {"layers.0.q_proj.weight", "layers.3.k_base", "layers.3.b", "layers.2.k_norm.weight"} <= set(load_file(str(path)))
    loaded, info = fastkvzip_gate.load(path)
    assert (info["heads"], info["group"], info["dim"], info["sinks"], info["n_modules"]) == (2, 2, 16, 16, 4)
    hidden = torch.randn(30, 64, generator=torch.Generator().manual_seed(0))
    stored = random_gate(64, 2, 2, seed=1).half().float()  # float16 on disk
    assert torch.allclose(fastkvzip_gate.predict(loaded[1], hidden), fastkvzip_gate.predict(stored, hidden), atol=1e-6)
    path.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="FastKVzip gates .* do not load"):
        make_method(f"fastkvzip:weights={path}")
    with pytest.raises(UserError, match="do not exist; fit them with ripplekv fit fastkvzip"):
        make_method(f"fastkvzip:weights={tmp_path / 'missing.safetensors'}")


def test_fastkvzip_keeps_exact_budgets_by_its_gates_scores(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 101, (300,), generator=torch.Generator().manual_seed(0))
    path = tiny_gates(tmp_path)
    uniform = make_method(f"fastkvzip:allocator=uniform:weights={path}:window=0:n_sink=0")
    press = make_method(f"fastkvzip:granularity=entry:weights={path}:window=0:window_ratio=0.02")
    default = make_method(f"fastkvzip:weights={path}")
    state = prefill_for(model, ids, Requirements.of_all([uniform, press, default]))
    gates, _ = fastkvzip_gate.load(path)
    by_layer = [by_hand(gates[layer], state.signal("hidden_states")[layer]) for layer in range(4)]  # [H, n]
    for budget in (40, 128):
        assert [int(m.select(state, budget).sum()) for m in (uniform, press, default)] == [4 * 2 * budget] * 3
        kept = uniform.select(state, budget)
        for layer in range(4):
            for head in range(2):
                top = set(torch.argsort(by_layer[layer][head], descending=True, stable=True)[:budget].tolist())
                assert set(torch.nonzero(kept[layer, head]).flatten().tolist()) == top
        # the press: sinks and its window (int(300 x 0.02) = 6) score 1, the rest compete over all layers and heads
        scores = torch.stack(by_layer)
        scores[..., :4] = 1.0
        scores[..., -6:] = 1.0
        chosen = torch.zeros(scores.numel(), dtype=torch.bool)
        chosen[torch.argsort(scores.flatten(), descending=True, stable=True)[: 4 * 2 * budget]] = True
        assert torch.equal(press.select(state, budget).bool(), chosen.view(scores.shape))
        assert default.select(state, budget)[..., -32:].all()  # our window
    assert default.label == f"fastkvzip:weights={path.name}"


def test_refusals_are_one_line_and_name_the_fit_command(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 101, (120,), generator=torch.Generator().manual_seed(0))
    state = prefill_for(model, ids, Requirements(signals={"hidden_states"}))
    with pytest.raises(UserError) as refused:
        make_method("fastkvzip").select(state, 40)
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("fastkvzip has no fitted gates for this model; fit them on calibration prompts: "
                                         "ripplekv fit fastkvzip --model M --out DIR")
    with pytest.raises(UserError, match="FastKVzip gates .* was fitted for 3 layers x 2 KV heads x 64 hidden size; the "
                                        "model has 4 layers x 2 KV heads x 64 hidden size; fit them on calibration prompts: "
                                        "ripplekv fit"):
        make_method(f"fastkvzip:weights={tiny_gates(tmp_path, layers=3)}").select(state, 40)
    with pytest.raises(UserError, match="window_ratio must be at least 0"):
        make_method("fastkvzip:window_ratio=1.5")
    # before any prefill (eval, the API): another model has no shipped gates; the bundled model's must fit its shape
    with pytest.raises(UserError, match="^fastkvzip has no fitted gates for this model; fit them on calibration"):
        make_method("fastkvzip").check_fitted((4, 2, 64), bundled=False)
    with pytest.raises(UserError, match="was fitted for 30 layers x 3 KV heads x 576 hidden size; the model has 4 layers "
                                        "x 2 KV heads"):
        make_method("fastkvzip").check_fitted((4, 2, 64), bundled=True)


def test_the_press_window_is_two_percent_of_the_prompt_or_4096_from_32000_tokens():
    from ripplekv.methods.fastkvzip.method import ratio_window

    assert [ratio_window(n, 0.02) for n in (10, 809, 31999, 32000)] == [1, 16, 639, 4096]
    assert ratio_window(809, 0.0) == 0


def test_the_shipped_gates_are_where_fastkvzip_looks():
    from ripplekv.methods.fastkvzip.method import shipped_gates

    path = shipped_gates()
    gates, info = fastkvzip_gate.load(path)
    assert (len(gates), info["heads"], info["input_dim"], info["model"]) == (30, 3, 576, "smollm2-135m")
    assert info["held_out_fit"]["spearman_mean"] > 0 and info["calibration_ids"]


@pytest.mark.parametrize("args, message", [
    (["--holdout", "1"], "--holdout at least 2"),
    (["--steps", "0"], "must be positive"),
    (["--calib-samples", "2"], "must be at least --holdout (4)"),
])
def test_fit_fastkvzip_refuses_in_one_line(tmp_path, tiny_model_dir, args, message):
    result = run("fit", "fastkvzip", "--model", tiny_model_dir, "--out", tmp_path / "out", "--target-tokens", 300, *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fit_fastkvzip_writes_gates_from_kvzip_scores_and_resumes(tmp_path, tiny_model_dir):
    import numpy as np

    out = tmp_path / "fastkvzip"
    args = ["fit", "fastkvzip", "--model", tiny_model_dir, "--calib-samples", 2, "--holdout", 2, "--tokens", 16,
            "--steps", 3, "--batch", 8, "--target-tokens", 300, "--device", "cpu", "--out", out]
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith(f"fit fastkvzip: writing to {out}\n") and "held-out rank correlation" in first.stderr
    info = json.loads((out / "fastkvzip.json").read_text())
    assert (info["n_modules"], info["heads"], info["group"], info["input_dim"]) == (4, 2, 2, 32)
    assert (info["train_pairs"], info["held_out_pairs"], info["steps"], info["batch"]) == (16, 16, 3, 8)
    # the gates are the fit of the logged pairs' KVzip scores (exp of the logged log scores), layer by layer
    line = json.loads((out / "samples.jsonl").read_text().splitlines()[1])["value"]
    pairs = np.load(out / line["pairs"])
    gates, _ = fastkvzip_gate.load(out / "fastkvzip.safetensors")
    for layer in (0, 3):
        expected = fastkvzip_gate.fit_gate(torch.from_numpy(pairs["hidden"][layer]),
                                           torch.from_numpy(np.exp(pairs["targets"][layer])), 2, 3, 0.2, 8, layer)
        for name, value in expected.state_dict().items():
            assert torch.allclose(gates[layer].state_dict()[name], value.half().float()), name
    log = (out / "samples.jsonl").read_text()
    again = run(*args[:-6], "--steps", 4, "--batch", 8, "--target-tokens", 300, "--device", "cpu", "--out", out)
    assert again.returncode == 0, again.stderr
    assert (out / "samples.jsonl").read_text() == log  # every prompt was done: none collected again
    assert json.loads((out / "fastkvzip.json").read_text())["steps"] == 4  # refitted on the same pairs
    other = run(*args[:-2], "--tokens", 32, "--out", out)
    assert other.returncode == 2 and "use a new --out directory" in other.stderr  # other pairs, another folder
