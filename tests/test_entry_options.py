"""merge= and rerotate= on any method: the same entries kept (exact budgets), their values or keys rewritten as the
formulas say, recomputed here by hand, one entry at a time."""

from __future__ import annotations

import math

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from tests.conftest import tiny_llama

N = 120


@pytest.fixture(scope="module", params=[(4, 2, 64), (4, 4, 64)], ids=["gqa2", "mha"])
def setting(request):
    heads, kv_heads, hidden = request.param
    model = tiny_llama(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return model, prefill_for(model, torch.arange(N) % 89 + 5, Requirements(capture_window=32))


def kept_of(entries, head: int) -> list[int]:
    count = int(entries.counts[head])
    return entries.positions[head, :count].tolist()


def hand_kvpress_merge(keys, values, kept: list[int]) -> dict[int, torch.Tensor]:
    """MergingPress's rule written out: each evicted position to its most cosine-similar kept key, weight
    max(cos, 0) |v_e| / (|v_e| + |v_t|); a kept value (v_t + sum w v_e) / (1 + sum w)."""
    keys, values = keys.double(), values.double()
    sums = {t: torch.zeros_like(values[0]) for t in kept}
    weights = dict.fromkeys(kept, 0.0)
    for e in range(len(keys)):
        if e in kept:
            continue
        cosines = [float(keys[e] @ keys[t] / (keys[e].norm() * keys[t].norm())) for t in kept]
        target = kept[max(range(len(kept)), key=lambda i: cosines[i])]
        best = max(cosines)
        w = max(best, 0.0) * float(values[e].norm()) / float(values[e].norm() + values[target].norm())
        sums[target] += w * values[e]
        weights[target] += w
    return {t: (values[t] + sums[t]) / (1 + weights[t]) if weights[t] > 0 else values[t] for t in kept}


def hand_window_mass(state, layer: int, head: int, window: int = 32) -> list[float]:
    """Attention the last `window` queries pay each key (causal, softmax per query), summed, averaged over the query
    heads of KV head `head`."""
    queries = state.signal("window_queries")[layer][:, -window:].double()
    keys = state.keys[layer][head].double()
    group = queries.shape[0] // state.keys[layer].shape[0]
    n = keys.shape[0]
    mass = [0.0] * n
    for g in range(group):
        for i in range(window):
            at = n - window + i
            logits = [float(queries[head * group + g, i] @ keys[j]) * state.scaling for j in range(at + 1)]
            top = max(logits)
            total = sum(math.exp(x - top) for x in logits)
            for j, x in enumerate(logits):
                mass[j] += math.exp(x - top) / total / group
    return mass


def hand_cam_merge(values, kept: list[int], mass: list[float], neighbours: int = 32) -> dict[int, torch.Tensor]:
    """CaM's merge in expectation: an evicted value over the next `neighbours` kept entries after it, each getting
    min(1, A_e / mean A_targets) / (their number) of it."""
    values = values.double()
    merged = {t: values[t].clone() for t in kept}
    for e in range(len(values)):
        if e in kept:
            continue
        targets = [t for t in kept if t > e][:neighbours]
        if not targets:
            continue
        mean = sum(mass[t] for t in targets) / len(targets)
        probability = min(1.0, mass[e] / mean) if mean > 0 else (1.0 if mass[e] > 0 else 0.0)
        for t in targets:
            merged[t] += probability / len(targets) * values[e]
    return merged


@pytest.mark.parametrize("spec", ["snapkv", "snapkv:split=adakv", "streamingllm"])
@pytest.mark.parametrize("rule", ["kvpress", "cam"])
def test_merging_keeps_the_same_entries_and_folds_the_evicted_values_in(setting, spec, rule):
    _, state = setting
    plain, merged = make_method(spec), make_method(f"{spec}:merge={rule}")
    budget = 24
    assert merged.budgets(state, budget).tolist() == plain.budgets(state, budget).tolist()  # exact budgets
    before, after = plain.compress(state, budget), merged.compress(state, budget)
    for layer, (old, new) in enumerate(zip(before, after)):
        assert torch.equal(old.positions, new.positions) and torch.equal(old.keys, new.keys)
        for head in (0, old.num_heads - 1):
            kept = kept_of(old, head)
            keys, values = state.keys[layer][head], state.values[layer][head]
            if rule == "kvpress":
                want = hand_kvpress_merge(keys, values, kept)
            else:
                want = hand_cam_merge(values, sorted(kept), hand_window_mass(state, layer, head))
            for slot, position in enumerate(kept):
                assert torch.allclose(new.values[head, slot].double(), want[position], atol=1e-5), (layer, head, position)
    assert any(not torch.equal(old.values, new.values) for old, new in zip(before, after))


def test_merging_leaves_a_layer_that_keeps_everything_and_the_prefill_alone(setting):
    _, state = setting
    values = [v.clone() for v in state.values]
    built = make_method("snapkv:merge=kvpress").compress(state, N)
    assert all(layer.values is state.full_entries(index).values for index, layer in enumerate(built))
    make_method("snapkv:merge=cam").compress(state, 16)
    assert all(torch.equal(a, b) for a, b in zip(values, state.values))


def rotate(key: torch.Tensor, angle_step: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of a key by `angle_step` positions (the rotate-half pairing: channel i with i + d/2)."""
    half = key.shape[-1] // 2
    angles = angle_step * inv_freq.double()
    first, second = key[:half].double(), key[half:].double()
    return torch.cat([first * torch.cos(angles) - second * torch.sin(angles),
                      second * torch.cos(angles) + first * torch.sin(angles)])


@pytest.mark.parametrize("spec", ["snapkv", "pyramidkv:split=adakv"])
def test_rerotation_moves_each_kept_key_to_a_contiguous_position_ending_at_the_prompts_end(setting, spec):
    model, state = setting
    inv_freq = model.model.rotary_emb.inv_freq
    plain, moved = make_method(spec), make_method(f"{spec}:rerotate=1")
    budget = 20
    assert moved.budgets(state, budget).tolist() == plain.budgets(state, budget).tolist()
    for layer, (old, new) in enumerate(zip(plain.compress(state, budget), moved.compress(state, budget))):
        assert torch.equal(old.positions, new.positions) and torch.equal(old.values, new.values)
        for head in range(old.num_heads):
            kept = kept_of(old, head)
            order = sorted(range(len(kept)), key=lambda slot: kept[slot])
            for rank, slot in enumerate(order):
                target = N - len(kept) + rank
                want = rotate(old.keys[head, slot], target - kept[slot], inv_freq)
                assert torch.allclose(new.keys[head, slot].double(), want, atol=1e-4), (layer, head, slot)


def test_rerotated_attention_matches_kvpress_numbering(setting):
    """kvpress puts c kept keys at 0..c-1 and the next token at c; ours at n-c..n-1 and n: every logit is the same."""
    model, state = setting
    inv_freq = model.model.rotary_emb.inv_freq
    built = make_method("snapkv:rerotate=1").compress(state, 16)[1]
    kept = kept_of(built, 0)
    query = torch.randn(built.keys.shape[-1], generator=torch.Generator().manual_seed(3)).double()
    ours = [float(rotate(query, N, inv_freq) @ built.keys[0, slot].double()) for slot in range(len(kept))]
    source = state.keys[1][0]
    theirs = [float(rotate(query, len(kept), inv_freq) @ rotate(source[p], rank - p, inv_freq))
              for rank, p in enumerate(sorted(kept))]
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_entry_options_compose_and_refuse_what_they_cannot_rewrite(setting):
    _, state = setting
    both = make_method("snapkv:rerotate=1:merge=cam")
    assert both.label == "snapkv:merge=cam:rerotate=1" and both.describe()["merge"]["rule"] == "cam"
    stored = make_method("snapkv:merge=kvpress:quant=kivi:bits=4:group=8:residual=16")
    assert stored.label == "snapkv:merge=kvpress:quant=kivi:bits=4:group=8:residual=16"
    assert stored.budgets(state, 24).sum() > make_method("snapkv").budgets(state, 24).sum()
    assert make_method("snapkv:merge=kvpress").decode_policy(4) is None  # refused under --decode-budget total
    for bad, message in (("full:merge=kvpress", "evicts nothing"), ("gracekv:merge=kvpress", "prototypes"),
                         ("snapkv:merge=tome", "one of kvpress, cam"), ("snapkv:rerotate=0", "drop the option"),
                         ("snapkv:rerotate=yes", "rerotate=1"), ("kivi:merge=cam", "kivi takes only")):
        with pytest.raises(UserError, match=message):
            make_method(bad)


def test_eval_runs_every_new_option_and_records_what_it_spent(tiny_model_dir, tmp_path, run_cli):
    import json

    methods = ["snapkv", "snapkv:think=0.5", "snapkv:merge=kvpress", "snapkv:merge=cam:rerotate=1"]
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", ",".join(methods), "--budget", "64",
                           "--batch-size", "4", "--out", str(out))
    assert code == 0, err
    lines = {line["method"]: line for line in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    assert lines["snapkv:merge=kvpress"]["kept_entries"] == lines["snapkv"]["kept_entries"]
    assert lines["snapkv:merge=cam:rerotate=1"]["kv_bytes"] == lines["snapkv"]["kv_bytes"]
    think = lines["snapkv:think=0.5"]
    assert think["kept_entries"] > lines["snapkv"]["kept_entries"] and think["kv_bytes"] <= think["kv_budget_bytes"]
    specs = json.loads((out / "config.json").read_text())
    assert "key_channels" in json.dumps(specs) and "merge" in json.dumps(specs)
    assert "think" in (out / "memory_axis.csv").read_text()
