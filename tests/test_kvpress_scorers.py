"""kvpress 0.5.5's training-free presses (leverage, noncausal, compactor, cur, capkv, kvcompose) against their formulas
written out here by letter on a tiny model's own projections, cache and eager attention, their exact budgets, and an
eval's entry counts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from tests.conftest import satisfy, tiny_llama

N = 120
LAYERS, KV, Q, D = 4, 2, 4, 16
GROUP = Q // KV
OURS = ("leverage", "noncausal", "compactor", "cur", "capkv", "kvcompose")
SPECS = (*OURS, "noncausal:chunk_size=32", "compactor:chunk_size=32:blending=0.5", "compactor:chunk_size=32",
         "cur:leverage_type=kv_avg:use_local_approximation=0", "cur:use_random_leverage=1:seed=3", "capkv:tau=2",
         "kvcompose:agg_task=mean:agg_group=max:add_v_norm=1:agg_head=max:keep_token_lower_bound=3")


@pytest.fixture(scope="module")
def setup():
    """Our prefill of a tiny Llama and, from an identical copy, each layer's projections (before RoPE), the
    queries after RoPE, and the plain cache."""
    ids = torch.randint(3, 101, (N,), generator=torch.Generator().manual_seed(1))
    state = satisfy(prefill(tiny_llama(), ids, requirements=Requirements.of_all(make_method(s) for s in SPECS)))
    eager = tiny_llama()
    seen = {}
    hooks = []
    for layer, block in enumerate(eager.model.layers):
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(block.self_attn, name).register_forward_hook(
                lambda m, i, o, key=(name, layer): seen.__setitem__(key, o[0].detach().float())))
    with torch.no_grad():
        out = eager(input_ids=ids[None], use_cache=True)
    for hook in hooks:
        hook.remove()
    cos, sin = eager.model.rotary_emb(torch.zeros(1), torch.arange(N)[None])
    cos, sin = cos[0], sin[0]
    layers = []
    for layer in range(LAYERS):
        queries = seen["q_proj", layer].view(N, Q, D).transpose(0, 1)  # [Q, N, D] before RoPE
        half = torch.cat([-queries[..., D // 2:], queries[..., : D // 2]], -1)
        layers.append({"queries": queries, "rotated": queries * cos + half * sin,
                       "prerope_keys": seen["k_proj", layer].view(N, KV, D).transpose(0, 1),
                       "keys": out.past_key_values.layers[layer].keys[0].float(),
                       "values": out.past_key_values.layers[layer].values[0].float()})
    return eager, state, layers


def z(scores):
    return (scores - scores.mean()) / scores.std()


def leverage_formula(keys, layer, seed=0, size=48):
    """z-scored diag(X (X^T X + 0.01 I)^-1 X^T), X = centred keys x the seeded sketch, by the hat matrix in float64."""
    sketch = torch.randn(1, KV, D, size, generator=torch.Generator().manual_seed(seed + layer))[0] / math.sqrt(size)
    rows = []
    for h in range(KV):
        x = ((keys[h] - keys[h].mean(0)) @ sketch[h]).double()
        hat = x @ torch.linalg.inv(x.T @ x + 0.01 * torch.eye(size, dtype=torch.float64)) @ x.T
        rows.append(hat.diagonal().clamp_min(0))
    return z(torch.stack(rows)).float()


def noncausal_formula(rotated, keys, values, chunk):
    """Unscaled softmax inside chunks (zero-padded to `chunk`; the padding's logits are 0), column sums, mean over a
    KV head's query heads, x ||v||, mean of each entry and its two neighbours (0 beyond the edges), z-scored."""
    length = keys.shape[1]
    columns = torch.zeros(Q, length)
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        padding = chunk - (stop - start)
        for h in range(Q):
            logits = rotated[h, start:stop] @ keys[h // GROUP, start:stop].T
            weights = logits.exp() / (logits.exp().sum(-1, keepdim=True) + padding)
            columns[h, start:stop] += weights.sum(0) + padding / chunk  # a zero query attends evenly
    scores = columns.view(KV, GROUP, length).mean(1) * values.norm(dim=-1)
    padded = torch.nn.functional.pad(scores, (1, 1))
    return z((padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]) / 3)


def test_leverage_is_the_sketched_hat_matrix_diagonal_and_seeded(setup):
    _, state, layers = setup
    scorer = make_method("leverage:window=0").scorer
    for layer in range(LAYERS):
        expected = leverage_formula(layers[layer]["prerope_keys"], layer)
        assert torch.allclose(scorer.scores(state, layer), expected, atol=2e-3)
    again = make_method("leverage:window=0").scorer.scores(state, 1)
    other = make_method("leverage:window=0:seed=5").scorer
    assert torch.equal(again, scorer.scores(state, 1))
    assert torch.allclose(other.scores(state, 1), leverage_formula(layers[1]["prerope_keys"], 1, seed=5), atol=2e-3)
    assert not torch.allclose(other.scores(state, 1), again, atol=1e-2)


@pytest.mark.parametrize("chunk", [256, 32])
def test_noncausal_is_chunked_attention_without_mask_times_value_norm(setup, chunk):
    _, state, layers = setup
    scorer = make_method(f"noncausal:chunk_size={chunk}").scorer
    for layer in range(LAYERS):
        parts = layers[layer]
        expected = noncausal_formula(parts["rotated"], parts["keys"], parts["values"], chunk)
        assert torch.allclose(scorer.scores(state, layer), expected[:, : N - 32], atol=1e-4)


def test_compactor_blends_both_between_its_sinks(setup):
    _, state, layers = setup
    fixed = make_method("compactor:chunk_size=32:blending=0.5:window=0").scorer
    for layer in range(LAYERS):
        parts = {key: value[:, 8 : N - 4] for key, value in layers[layer].items()}
        inner = 0.5 * leverage_formula(parts["prerope_keys"], layer) + noncausal_formula(
            parts["rotated"], parts["keys"], parts["values"], 32)
        scores = fixed.scores(state, layer)
        assert torch.allclose(scores[:, 8 : N - 4], inner, atol=2e-3)
        assert torch.allclose(scores[:, :8], inner.max().expand(KV, 8), atol=2e-3)
        assert torch.allclose(scores[:, N - 4 :], inner.max().expand(KV, 4), atol=2e-3)
    # blending unset: the compression ratio of the head's own count, 1 - kept / n, as kvpress's default
    ratio = make_method("compactor:chunk_size=32:window=0")
    at_ratio = make_method(f"compactor:chunk_size=32:window=0:blending={1 - 40 / N}")
    assert torch.equal(ratio.select(state, 40), at_ratio.select(state, 40))
    assert not torch.equal(ratio.select(state, 40), make_method("compactor:chunk_size=32:window=0:blending=0").select(state, 40))


def cur_formula(keys, values, kind="kv_product", local=True, block=16, sinks=4):
    k2, v2 = keys.square().sum(-1), values.square().sum(-1)
    if local:
        for square in (k2, v2):
            for start in range(0, square.shape[1], block):
                square[:, start : start + block] /= square[:, start : start + block].sum(-1, keepdim=True).clone()
    scores = {"kv_product": k2 * v2, "kv_avg": (k2 + v2) / 2}[kind]
    scores = scores / scores.sum(-1, keepdim=True)
    scores[:, :sinks] = 1.0
    return scores


def test_cur_is_block_normalized_key_and_value_norms(setup):
    _, state, layers = setup
    for spec, options in (("cur", {}), ("cur:leverage_type=kv_avg:use_local_approximation=0", {"kind": "kv_avg", "local": False})):
        scorer = make_method(spec).scorer
        for layer in range(LAYERS):
            expected = cur_formula(layers[layer]["keys"].clone(), layers[layer]["values"].clone(), **options)
            assert torch.allclose(scorer.scores(state, layer), expected[:, : N - 32], rtol=1e-5, atol=1e-8)
    projected = make_method("cur:use_random_leverage=1:seed=3").scorer
    projection = torch.randn(D, 20, generator=torch.Generator().manual_seed(3 + 2)) / math.sqrt(20)
    expected = cur_formula(layers[2]["keys"] @ projection, layers[2]["values"] @ projection)
    assert torch.allclose(projected.scores(state, 2), expected[:, : N - 32], rtol=1e-4, atol=1e-8)


def test_capkv_is_weighted_value_leverage_under_the_averaged_query(setup):
    eager, state, layers = setup
    positions = torch.arange(N, N + 512)
    cos, sin = eager.model.rotary_emb(torch.zeros(1), positions[None])
    basis = torch.eye(D)
    rotation = torch.stack([basis * cos[0, t] + torch.cat([-basis[:, D // 2:], basis[:, : D // 2]], -1) * sin[0, t]
                            for t in range(512)]).mean(0).T  # column i = mean R_t e_i
    for tau in (5.0, 2.0):
        scorer = make_method(f"capkv:window=0:tau={tau:g}").scorer
        for layer in range(LAYERS):
            parts = layers[layer]
            keys, values = parts["keys"][:, 4:].double(), parts["values"][:, 4:].double()
            expected = torch.zeros(KV, N - 4, dtype=torch.float64)
            for h in range(Q):
                anchor = (rotation @ parts["queries"][h, 4:].mean(0)).double()
                k = keys[h // GROUP]
                cosine = (k @ anchor) / (k.norm(dim=-1) * anchor.norm())
                weights = torch.exp(tau * (cosine - cosine.max()))
                v = values[h // GROUP]
                capacity = torch.eye(D, dtype=torch.float64) + (v.T * (weights + 1e-6)) @ v
                spread = (v @ torch.linalg.inv(capacity) * v).sum(-1)
                expected[h // GROUP] += weights * spread / GROUP
            scores = scorer.scores(state, layer)
            assert torch.allclose(scores[:, 4:].double(), expected, rtol=1e-3, atol=1e-6)
            assert bool((scores[:, :4] > expected.max()).all())  # the sinks are kept


def test_kvcompose_scores_are_a_second_readings_attention_and_its_budgets_composite_tokens(setup):
    eager, state, layers = setup
    twice = torch.cat([state.input_ids, state.input_ids])[None]
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        maps = eager(input_ids=twice, output_attentions=True).attentions
    eager.set_attn_implementation("sdpa")
    method = make_method("kvcompose:window=0")
    composites = []
    for layer in range(LAYERS):
        reread = maps[layer][0, :, N:, :N].float()  # [Q, N repeated queries, N prompt entries]
        expected = reread.amax(1).view(KV, GROUP, N).mean(1)
        expected = expected + expected.mean(0, keepdim=True)
        assert torch.allclose(method.scorer.scores(state, layer), expected, atol=1e-5)
        other = reread.mean(1).view(KV, GROUP, N).amax(1) * layers[layer]["values"].norm(dim=-1)
        scorer = make_method("kvcompose:window=0:agg_task=mean:agg_group=max:add_v_norm=1:add_mean_across_heads=0").scorer
        assert torch.allclose(scorer.scores(state, layer), other, atol=1e-5)
        composites.append(expected.sort(-1, descending=True).values.mean(0))
    composites = torch.stack(composites)
    composites[0] = composites.amax(0)
    for budget in (16, 40):
        top = torch.topk(composites.reshape(-1), LAYERS * budget).indices // N
        counts = method.budgets(state, budget)
        assert counts[:, 0].tolist() == torch.bincount(top, minlength=LAYERS).tolist()
        theirs = make_method("kvcompose:window=0:rounding=kvpress").budgets(state, budget)  # kvpress: clamped at 1
        assert theirs[:, 0].tolist() == torch.bincount(top, minlength=LAYERS).clamp(min=1).tolist()
        assert (counts == counts[:, :1]).all()  # a layer's heads keep as many (structured)
        kept = method.select(state, budget)
        for layer in range(LAYERS):
            for head in range(KV):
                ranked = method.scorer.scores(state, layer)[head].argsort(descending=True)[: counts[layer, head]]
                assert kept[layer, head].nonzero()[:, 0].tolist() == sorted(ranked.tolist())


def test_kvcompose_kvpress_rounding_raises_a_layer_that_won_nothing_past_the_budget():
    """kvpress's top-k over every layer's composite tokens, then each layer at least max(1, keep_token_lower_bound):
    a layer that won no entry keeps one all the same, so the total passes L x B (what `rounding=exact` removes)."""
    from ripplekv.methods.kvcompose import kvpress_counts

    composites = torch.tensor([[10.0] * 10, [5.0] * 10, [0.0] * 10])
    assert kvpress_counts(composites, 4, 0, 1, 10) == [10, 2, 1]  # 13 entries a head, not 3 x 4
    assert kvpress_counts(composites, 4, 0, 3, 10) == [10, 3, 3]  # keep_token_lower_bound = 3
    assert kvpress_counts(composites, 4, 2, 1, 12) == [8, 2, 2]  # a window of 2 kept beside the top 3 x (4 - 2)


def test_kvcompose_kvpress_rounding_ranks_every_entry_of_the_prompt(setup, monkeypatch):
    """`kvcompose:window=0:rounding=kvpress` ranks every entry's composite (no floor of one held back per layer),
    so a layer whose best composite falls under the cut wins nothing and is clamped to one past L x B."""
    from ripplekv.methods.kvcompose import CompositeBudgets

    _, state, _ = setup
    designed = torch.arange(LAYERS * N, dtype=torch.float32).view(LAYERS, N).flip(1)  # layer 3's over all others
    monkeypatch.setattr(CompositeBudgets, "composites", lambda self, state, scorer, floor: designed[:, floor:])
    counts = make_method("kvcompose:window=0:rounding=kvpress").budgets(state, 16)[:, 0]
    assert counts.tolist() == [1, 1, 1, LAYERS * 16]  # all 64 won by layer 3, the others clamped: 3 past L x B
    exact = make_method("kvcompose:window=0").budgets(state, 16)[:, 0]
    assert exact.tolist() == [1, 1, 1, LAYERS * 16 - 3]  # a floor of one each, the rest to layer 3: L x B


@pytest.mark.parametrize("budget", [16, 40, 100])
@pytest.mark.parametrize("spec", [*SPECS, "compactor:split=adakv", "pyramidkv:scorer=leverage", "cur:window=0",
                                  "kvcompose:allocator=global:granularity=entry", "kvcompose:split=adakv"])
def test_each_keeps_exactly_snapkvs_total(setup, spec, budget):
    _, state, _ = setup
    method = make_method(spec)
    built = method.compress(state, budget)
    kept = np.array([layer.counts.tolist() for layer in built])
    assert (kept == method.budgets(state, budget)).all()
    assert kept.sum() == sum(int(layer.counts.sum()) for layer in make_method("snapkv").compress(state, budget))
    assert kept.sum() == LAYERS * KV * budget


@pytest.mark.parametrize("spec, message", [
    ("cur:leverage_type=both", "leverage_type must be one of"),
    ("cur:seed=2", "seed"),
    ("leverage:sketch_dimension=0", "sketch_dimension must be a positive integer"),
    ("compactor:blending=-1", "blending must be >= 0"),
    ("capkv:n_sink=40", "n_sink must be at most"),
    ("noncausal:chunk_size=0", "chunk_size must be a positive integer"),
    ("kvcompose:agg_head=median", "agg_head must be one of max, mean"),
    ("kvcompose:rounding=floor", "rounding must be one of exact, kvpress"),
])
def test_option_mistakes_are_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        make_method(spec)


def test_an_eval_keeps_snapkvs_entry_count_for_each(tmp_path, tiny_model_dir, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", ",".join(("snapkv", *OURS)), "--budget", "64",
                           "--out", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    kept = {row["method"]: row["kept_entries"] for row in rows if row["method"] != "full"}
    assert set(kept) == {"snapkv", *OURS}
    assert len(set(kept.values())) == 1 and kept["snapkv"] == 4 * 2 * 64
