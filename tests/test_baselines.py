"""The papers' baselines against naive references: H2O, TOVA, KNorm, CAKE and DepthKV."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.engine.recorders import WINDOW_QUERIES
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.budgets import integer_budgets
from ripplekv.methods.signals import column_sums as accumulate
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from ripplekv.pipeline import evaluate
from tests.test_budgets import fake_state


def kept_prefix(mask_row: torch.Tensor, window: int) -> set[int]:
    return set(mask_row[:-window].nonzero().flatten().tolist()) if window else set(mask_row.nonzero().flatten().tolist())


def assert_keeps_window_and_top(masks, scores_by_layer, window: int, budget: int):
    """Every head keeps the last `window` tokens and exactly the top `budget - window` prefix scores."""
    for layer, scores in enumerate(scores_by_layer):
        for head in range(scores.shape[0]):
            kept = masks[layer, head]
            assert kept[kept.shape[0] - window :].all()
            expected = set(torch.argsort(scores[head], descending=True)[: budget - window].tolist())
            assert kept_prefix(kept, window) == expected


# --------------------------------------------------------------------------- H2O


@pytest.mark.parametrize("rows_per_chunk", [7, 1000])
def test_accumulated_attention_is_the_column_sums_of_the_eager_attention_map(tiny_model, monkeypatch, rows_per_chunk):
    ids = torch.randint(0, 101, (50,), generator=torch.Generator().manual_seed(1))
    heads, kv_heads = tiny_model.config.num_attention_heads, tiny_model.config.num_key_value_heads
    monkeypatch.setattr(accumulate, "QUERY_ROWS", rows_per_chunk)  # several chunks, or one
    plain = prefill(tiny_model, ids)
    state = prefill(tiny_model, ids, requirements=Requirements(signals={COLUMN_SUMS}))
    assert COLUMN_SUMS not in plain.signals
    tiny_model.set_attn_implementation("eager")
    with torch.no_grad():
        maps = tiny_model(ids[None], output_attentions=True).attentions  # per layer [1, H_q, n, n]
    for layer, attention in enumerate(maps):
        expected = attention[0].sum(1).view(kv_heads, heads // kv_heads, 50).mean(1)
        assert state.signal(COLUMN_SUMS)[layer].dtype == torch.float32
        assert torch.allclose(state.signal(COLUMN_SUMS)[layer], expected, atol=1e-5)
        # The sums are recorded beside the stock kernel, which still computes every layer's output.
        assert torch.equal(state.keys[layer], plain.keys[layer])
    assert torch.equal(state.last_logits, plain.last_logits)
    assert torch.allclose(sum(a.sum(-1) for a in state.signal(COLUMN_SUMS)) / len(maps), torch.full((kv_heads,), 50.0))


@pytest.mark.parametrize("mask_heads", [1, 4])
@pytest.mark.parametrize("additive", [False, True])
def test_accumulated_attention_applies_an_extra_mask_per_query_head(monkeypatch, mask_heads, additive):
    monkeypatch.setattr(accumulate, "QUERY_ROWS", 5)
    gen = torch.Generator().manual_seed(2)
    n, dim = 23, 8
    query, key = (torch.randn(1, h, n, dim, generator=gen) for h in (4, 2))
    visible = torch.rand(1, mask_heads, n, n, generator=gen) > 0.3
    visible |= torch.eye(n, dtype=torch.bool)  # every query sees itself
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")) if additive else visible
    columns = accumulate.column_sums(query, key, 0.5, mask)
    allowed = visible & torch.ones(n, n, dtype=torch.bool).tril()
    scores = (query @ key.repeat_interleave(2, 1).transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(-1)
    assert torch.allclose(columns, weights[0].sum(1).view(2, 2, n).mean(1), atol=1e-5)


def test_h2o_fixed_window_option_keeps_the_window_and_the_heaviest_hitters():
    state = fake_state(2, 200, kv_heads=2, query_heads=4, seed=3)
    masks = make_method("h2o:recent=0:window=16").select(state, 48)
    assert_keeps_window_and_top(masks, [a[:, :184] for a in state.signal(COLUMN_SUMS)], 16, 48)


@pytest.mark.parametrize("budget", [48, 49])
def test_h2o_default_splits_each_head_between_heavy_hitters_and_recent_tokens(budget):
    state = fake_state(2, 200, kv_heads=2, query_heads=4, seed=3)
    masks = make_method("h2o").select(state, budget)
    recent = budget // 2  # the paper's even split; the odd entry goes to the heavy hitters
    assert_keeps_window_and_top(masks, [a[:, : 200 - recent] for a in state.signal(COLUMN_SUMS)], recent, budget)


def test_h2o_mean_norm_is_kvpress_observed_attention():
    """norm=mean: column sums over the number of queries that see each key (n - j), kvpress's ObservedAttention."""
    state = fake_state(2, 200, kv_heads=2, query_heads=4, seed=3)
    masks = make_method("h2o:norm=mean:recent=0").select(state, 40)
    for layer, columns in enumerate(state.signal(COLUMN_SUMS)):
        for head in range(2):
            mean = [float(columns[head, j]) / (200 - j) for j in range(200)]
            expected = set(sorted(range(200), key=lambda j: -mean[j])[:40])
            assert set(masks[layer, head].nonzero().flatten().tolist()) == expected


def test_h2o_without_accumulation_is_one_clear_error():
    state = fake_state(1, 100)
    del state.signals[COLUMN_SUMS]
    with pytest.raises(UserError, match="did not record the signal 'accumulated_attention'"):
        make_method("h2o").select(state, 40)


def test_methods_say_whether_the_prefill_must_accumulate(tmp_path):
    alloc = tmp_path / "alloc.csv"
    alloc.write_text("layer,multiplier\n0,1\n1,1\n2,1\n3,1\n")
    route = tmp_path / "route.csv"
    route.write_text("layer,method\n0,snapkv\n1,h2o\n2,tova\n3,knorm\n")
    for methods, expected in ((["snapkv", "tova"], False), (["snapkv", "h2o"], True), (["depthkv"], True), (["routed"], True)):
        built = {m: make_method(m, shared={"allocation": str(alloc), "route": str(route)}) for m in ["full", *methods]}
        assert (COLUMN_SUMS in Requirements.of_all(built.values()).signals) == expected


# --------------------------------------------------------------------------- TOVA


def naive_last_query_attention(state, layer):
    """Head by head: the last window query of query head h against the keys of KV head h // group."""
    queries, keys = state.signal(WINDOW_QUERIES)[layer][:, -1], state.keys[layer]
    group = queries.shape[0] // keys.shape[0]
    rows = []
    for head in range(queries.shape[0]):
        logits = (keys[head // group].double() @ queries[head].double()) * state.scaling
        rows.append(torch.softmax(logits, dim=0))
    return torch.stack(rows)  # [H_q, n]


def test_tova_ranks_by_the_last_querys_attention_per_kv_head_and_per_layer():
    state = fake_state(2, 150, kv_heads=2, query_heads=6, seed=5)
    assert make_method("tova").scorer.heads == "layer"  # the paper's rule is the default
    for heads in ("kv", "layer"):
        method = make_method(f"tova:heads={heads}")
        masks = method.select(state, 30)
        expected = []
        for layer in range(2):
            attention = naive_last_query_attention(state, layer)
            per_kv = attention.view(2, 3, 150).mean(1) if heads == "kv" else attention.mean(0).expand(2, 150)
            expected.append(per_kv[:, :149])
            assert torch.allclose(method.scorer.scores(state, layer).double(), per_kv[:, :149], atol=1e-6)
        assert_keeps_window_and_top(masks, expected, 1, 30)
        if heads == "layer":
            assert torch.equal(masks[:, 0], masks[:, 1])


# --------------------------------------------------------------------------- KNorm


def test_knorm_default_ranks_every_entry_by_key_norm():
    state = fake_state(2, 120, kv_heads=3, query_heads=3, seed=7)
    masks = make_method("knorm").select(state, 20)
    for layer in range(2):
        for head in range(3):
            norms = [float(torch.linalg.vector_norm(state.keys[layer][head, i])) for i in range(120)]
            expected = set(sorted(range(120), key=lambda i: norms[i])[:20])
            assert set(masks[layer, head].nonzero().flatten().tolist()) == expected


def test_knorm_window_option_keeps_the_window_and_the_smallest_key_norms():
    state = fake_state(2, 120, kv_heads=3, query_heads=3, seed=7)
    masks = make_method("knorm:window=8").select(state, 20)
    for layer in range(2):
        for head in range(3):
            norms = [float(torch.linalg.vector_norm(state.keys[layer][head, i])) for i in range(112)]
            expected = set(sorted(range(112), key=lambda i: norms[i])[:12])
            assert masks[layer, head, -8:].all() and kept_prefix(masks[layer, head], 8) == expected


# --------------------------------------------------------------------------- CAKE


def naive_cake_preference(state, layer, window, tau1, tau2):
    """CAKE's preference from an explicit, head-by-head window attention (float64)."""
    queries, keys = state.signal(WINDOW_QUERIES)[layer][:, -window:].double(), state.keys[layer].double()
    n, group = keys.shape[1], queries.shape[0] // keys.shape[0]
    entropy = variance = 0.0
    for head in range(queries.shape[0]):
        logits = queries[head] @ keys[head // group].T * state.scaling  # [w, n]
        for i in range(window):
            logits[i, n - window + i + 1 :] = float("-inf")
        prefix = torch.softmax(logits, dim=-1)[:, : n - window]
        entropy -= float((prefix[prefix > 0] * prefix[prefix > 0].log()).sum())
        variance += float(((prefix - prefix.mean(0)) ** 2).sum(0).sum() / (window - 1))
    return entropy ** (1 / tau1) * variance ** (1 / tau2)


@pytest.mark.parametrize("tau1, tau2", [(1.0, 1.0), (1.6, 0.4)])
def test_cake_budgets_follow_the_naive_preferences_with_exact_totals(tau1, tau2):
    state = fake_state(4, 300, kv_heads=2, query_heads=4, seed=11)
    method = make_method(f"cake:window=16:tau1={tau1}:tau2={tau2}")
    prefs = np.array([naive_cake_preference(state, layer, 16, tau1, tau2) for layer in range(4)])
    assert np.allclose(method.allocator.preferences(state), prefs, rtol=1e-4)
    counts = method.budgets(state, 64)
    expected = integer_budgets((16 + 4 * 48 * prefs / prefs.sum()).tolist(), 64, 300, 16)
    assert counts[:, 0].tolist() == expected and (counts == counts[:, :1]).all()
    assert counts.sum() == 4 * 2 * 64 and len(set(expected)) > 1
    assert sum(layer.total() for layer in method.compress(state, 64)) == 4 * 2 * 64


def test_cake_options_are_checked_and_layer_budgets_need_a_prompt():
    with pytest.raises(UserError, match="tau1 must be a positive number"):
        make_method("cake:tau1=0")
    with pytest.raises(UserError, match="window must be an integer >= 2"):
        make_method("cake:window=1")
    with pytest.raises(UserError, match="depend on each prompt"):
        make_method("cake").layer_budgets(30, 128, 3500)


def test_budgets_command_shows_adakv_layers_and_refuses_cake_in_one_line(run_cli, tiny_model_dir):
    code, out, err = run_cli("budgets", "--methods", "snapkv,adakv", "--model", str(tiny_model_dir), "--format", "csv")
    assert code == 0 and "adakv,0,128" in out and "splits each layer's budget" in err
    code, out, err = run_cli("budgets", "--methods", "cake", "--model", str(tiny_model_dir))
    assert code == 2 and "depend on each prompt" in err and "Traceback" not in err


# --------------------------------------------------------------------------- DepthKV


def test_allocate_proportional_map_and_depthkv_budgets(run_cli, tiny_model_dir, tmp_path):
    sensitivity = tmp_path / "sensitivity.csv"
    pd.DataFrame({"layer": range(4), "kl_mean": [0.2, 0.6, 0.0, 0.2]}).to_csv(sensitivity, index=False)
    out = tmp_path / "alloc.csv"
    code, _, err = run_cli("allocate", str(sensitivity), "--map", "proportional", "--out", str(out),
                           "--model", str(tiny_model_dir))
    assert code == 0, err
    table = pd.read_csv(out)
    assert np.allclose(table["multiplier"], [0.8, 2.4, 0.0, 0.8]) and (table["map"] == "proportional").all()
    assert out.read_text() == ("layer,sensitivity,multiplier,map\n0,0.2,0.8,proportional\n1,0.6,2.4,proportional\n"
                               "2,0,0,proportional\n3,0.2,0.8,proportional\n")  # no --floor/--cap: as before they existed
    method = make_method("depthkv", allocation=str(out))
    assert method.scorer.name == "h2o" and method.allocator.name == "file"
    # Budgets proportional to sensitivity (the zero-sensitivity layer keeps H2O's floor, one entry), total exact.
    counts = method.layer_budgets(4, 100, 1000)
    assert counts == integer_budgets([80, 240, 0, 80], 100, 1000, 1) and counts[2] == 1 and sum(counts) == 400
    # H2O's earlier fixed window is the floor it asks for.
    windowed = make_method("depthkv:recent=0:window=32", allocation=str(out)).layer_budgets(4, 100, 1000)
    assert windowed == integer_budgets([80, 240, 0, 80], 100, 1000, 32) and windowed[2] == 32
    assert counts[1] > max(counts[0], counts[3]) and abs(counts[0] - counts[3]) <= 1 and min(counts[0], counts[3]) > counts[2]
    code, _, err = run_cli("allocate", str(sensitivity), "--map", "proportional", "--ratio", "2", "--out", str(out),
                           "--model", str(tiny_model_dir))
    assert code == 2 and "--map exponential only" in err
    code, _, err = run_cli("allocate", str(sensitivity), "--floor", "0.5", "--out", str(out), "--model", str(tiny_model_dir))
    assert code == 2 and "--map proportional only" in err
    code, _, err = run_cli("allocate", str(sensitivity), "--map", "linear", "--out", str(out), "--model", str(tiny_model_dir))
    assert code == 2 and err == "error: Invalid value for '--map': 'linear' is not one of 'exponential', 'proportional'.\n"


def test_allocate_proportional_floor_and_cap(run_cli, tiny_model_dir, tmp_path):
    sensitivity = tmp_path / "sensitivity.csv"
    pd.DataFrame({"layer": range(4), "kl_mean": [0.2, 0.6, 0.0, 0.2]}).to_csv(sensitivity, index=False)
    out = tmp_path / "bounded.csv"
    code, _, err = run_cli("allocate", str(sensitivity), "--map", "proportional", "--floor", "0.5", "--cap", "2",
                           "--out", str(out), "--model", str(tiny_model_dir))
    assert code == 0, err
    table = pd.read_csv(out)
    # s / mean(s) = [0.8, 2.4, 0, 0.8] bounded into [0.5, 2] with mean 1.
    assert np.allclose(table["multiplier"], [0.75, 2.0, 0.5, 0.75]) and (table["map"] == "proportional:floor=0.5:cap=2").all()
    counts = make_method("depthkv", allocation=str(out)).layer_budgets(4, 100, 1000)
    assert counts == [75, 200, 50, 75] and sum(counts) == 4 * 100  # the zero-sensitivity layer keeps B/2, not 1 entry
    for flags, message in [(["--cap", "1.2", "--floor", "0"], "cannot keep the mean multiplier at 1"),
                           (["--floor", "2"], "--floor must be"), (["--cap", "0.5"], "--cap must be")]:
        code, _, err = run_cli("allocate", str(sensitivity), "--map", "proportional", *flags, "--out", str(tmp_path / "x.csv"),
                               "--model", str(tiny_model_dir))
        assert code == 2 and message in err and "Traceback" not in err, (flags, err)
        assert not (tmp_path / "x.csv").exists()


@pytest.mark.slow
def test_eval_runs_every_baseline_with_exact_totals(run_cli, tiny_model_dir, tmp_path, monkeypatch):
    flags = []
    real = evaluate.prefill

    def recording(model, ids, needs, *args, **kwargs):
        flags.append(COLUMN_SUMS in needs.signals)
        return real(model, ids, needs, *args, **kwargs)

    monkeypatch.setattr(evaluate, "prefill", recording)
    alloc = tmp_path / "alloc.csv"
    alloc.write_text("layer,multiplier,map\n0,0.5,proportional\n1,1.5,proportional\n2,1,proportional\n3,1,proportional\n")
    out = tmp_path / "run"
    methods = "h2o,tova,knorm,adakv,cake,depthkv"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah",
                           "--limit", "1", "--target-tokens", "300", "--methods", methods, "--allocation", str(alloc),
                           "--budget", "48", "--out", str(out))
    assert code == 0, err
    assert flags == [True]  # h2o and depthkv need the accumulated attention: asked for in the one prefill
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"full", *methods.split(",")}
    for r in rows:
        if r["method"] != "full":
            assert r["kept_entries"] == 4 * 2 * 48 and sum(r["layer_budgets"]) == 4 * 48

