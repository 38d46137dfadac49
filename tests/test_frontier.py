"""The 2025-26 methods against hand-written formulas on a tiny model's eager attention, their exact budgets,
and the composition grammar (layer allocator x head split x scorer)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ripplekv.engine import timings
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.kvzip import RECONSTRUCTION
from ripplekv.methods.oracle import reference_answer
from ripplekv.methods.signals import continuation as probe
from ripplekv.methods.signals.query_statistics import QUERY_STATISTICS
from tests.conftest import StubTokenizer, satisfy, tiny_llama

N = 120
LAYERS, KV, Q, D = 4, 2, 4, 16
GROUP = Q // KV


def prompt(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 101, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def setup():
    """Our prefill of a tiny Llama and, from an identical copy, eager attention maps and the plain cache."""
    ids = prompt()
    model = tiny_llama()
    methods = [make_method(s) for s in ("expected-attention", "kvzip", "oracle", "criticalkv", "defensivekv")]
    state = satisfy(prefill(model, ids, requirements=Requirements.of_all(methods)))
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=ids[None], output_attentions=True, use_cache=True)
    return model, eager, ids, state, out


def window_maps(out, layer, window):
    """[H_q, w, n] eager attention of the last `window` queries."""
    return out.attentions[layer][0, :, -window:, :].float()


def wov_l1(eager, values, layer):
    """||v W_o^h||_1 per query head, averaged over a KV head's group: [KV, n], by the formula's letter."""
    weight = eager.model.layers[layer].self_attn.o_proj.weight.float()  # [hidden, Q*D]
    result = torch.zeros(KV, values.shape[1])
    for h in range(Q):
        block = weight[:, h * D:(h + 1) * D]  # the columns fed by query head h
        result[h // GROUP] += (values[h // GROUP] @ block.T).abs().sum(-1) / GROUP
    return result


def test_criticalkv_scores_and_two_stages_match_the_formula(setup):
    model, eager, ids, state, out = setup
    method = make_method("criticalkv:window=8")
    for layer in range(LAYERS):
        maps = window_maps(out, layer, 8)
        base = maps.sum(1).view(KV, GROUP, N).mean(1)[:, : N - 8]
        base = F.max_pool1d(base[:, None], 7, stride=1, padding=3)[:, 0]
        values = out.past_key_values.layers[layer].values[0].float()
        expected = (base / 8 + 1e-4) * wov_l1(eager, values, layer)[:, : N - 8]  # epsilon on the window's mean, as kvpress
        assert torch.allclose(method.scorer.critical_scores(state, layer), expected, rtol=1e-4, atol=1e-7)
        keep = method.scorer.keep(state, layer, torch.tensor([30, 30]))
        for head in range(KV):
            first = set(torch.topk(base[head], 30 // 2 - 8).indices.tolist())
            rest = expected[head].clone()
            rest[list(first)] = -1
            chosen = first | set(torch.topk(rest, 30 - 8 - len(first)).indices.tolist()) | set(range(N - 8, N))
            assert set(keep[head].nonzero().flatten().tolist()) == chosen


def test_keydiff_scores_are_minus_cosine_to_the_mean_unit_key(setup):
    _, _, _, state, out = setup
    scorer = make_method("keydiff").scorer
    for layer in range(LAYERS):
        keys = out.past_key_values.layers[layer].keys[0].float()
        anchor = (keys / keys.norm(dim=-1, keepdim=True)).mean(1)
        cosine = (keys @ anchor[..., None])[..., 0] / (keys.norm(dim=-1) * anchor.norm(dim=-1)[:, None])
        assert torch.allclose(scorer.scores(state, layer), -cosine[:, : N - 32], atol=1e-5)


def test_expected_attention_matches_gaussian_queries_and_averaged_rope(setup):
    model, eager, ids, state, out = setup
    captured = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o, k=k: captured.__setitem__(k, o[0].detach()))
             for k, layer in enumerate(eager.model.layers)]
    with torch.no_grad():
        eager(input_ids=ids[None])
    for hook in hooks:
        hook.remove()
    scorer = make_method("expected-attention").scorer
    # RoPE of each future position as a matrix, applied to e_i: averaged over positions n..n+511
    positions = torch.arange(N, N + 512)
    cos, sin = eager.model.rotary_emb(torch.zeros(1), positions[None])
    basis = torch.eye(D)
    rotation = torch.stack([basis * cos[0, t] + torch.cat([-basis[:, D // 2:], basis[:, : D // 2]], -1) * sin[0, t]
                            for t in range(512)]).mean(0).T  # column i = mean R_t e_i
    for layer in range(LAYERS):
        queries = captured[layer].view(N, Q, D).transpose(0, 1)[:, 4:].float()  # pre-RoPE, sinks left out
        keys = out.past_key_values.layers[layer].keys[0].float()[:, 4:]
        values = out.past_key_values.layers[layer].values[0].float()[:, 4:]
        expected = torch.zeros(KV, N - 4)
        for h in range(Q):
            mu = queries[h].mean(0)
            cov = (queries[h] - mu).T @ (queries[h] - mu) / queries.shape[1]
            mu, cov = rotation @ mu, rotation @ cov @ rotation.T
            k = keys[h // GROUP]
            logits = k @ mu / math.sqrt(D) + torch.einsum("mi,ij,mj->m", k, cov, k) / D / 2
            expected[h // GROUP] += torch.softmax(logits, 0) / GROUP
        expected = expected * values.norm(dim=-1)
        assert torch.allclose(scorer.expected(state, layer)[:, 4:], expected, rtol=1e-3, atol=1e-6)
        assert bool((scorer.expected(state, layer)[:, :4] > expected.max()).all())  # sinks kept


def test_defensivekv_scores_match_the_formula(setup):
    _, eager, _, state, out = setup
    scorer = make_method("defensivekv:window=8").scorer
    for layer in range(LAYERS):
        maps = window_maps(out, layer, 8)[:, :, : N - 8]  # [Q, w, m]
        m = N - 8
        pooled = torch.zeros_like(maps)
        for j in range(m):  # average pooling, kernel 5, zero padding counted
            pooled[..., j] = maps[..., max(0, j - 2): j + 3].sum(-1) / 5
        pooled = pooled / pooled.sum(-1, keepdim=True) * maps.sum(-1, keepdim=True)
        worst = pooled.reshape(KV, GROUP * 8, m).max(1).values
        worst = torch.maximum(worst, worst.mean(-1, keepdim=True))
        norms = wov_l1(eager, out.past_key_values.layers[layer].values[0].float(), layer)[:, :m]
        expected = worst * norms / norms.sum(0, keepdim=True)
        share = maps.reshape(KV, GROUP * 8, m).mean(1)
        share = share / share.sum(-1, keepdim=True)
        bias = float(maps[..., -8:].sum(-1).mean())
        got = scorer.scores(state, layer)
        top = expected.max()
        for head in range(KV):
            order = torch.argsort(share[head], descending=True)
            total, marked = 0.0, []
            for index in order.tolist():  # the entries that carry 0.9 - b of the mean attention
                if total + share[head, index] >= 0.9 - bias:
                    break
                total += float(share[head, index])
                marked.append(index)
            want = expected[head].clone()
            want[marked] = top + share[head, marked]
            assert torch.allclose(got[head], want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("piece", [512, 13])  # the repeat tokens in one forward, or in pieces of 13
def test_kvzip_scores_are_the_max_attention_of_the_repeat_pass(setup, piece, monkeypatch):
    model, eager, ids, state, out = setup
    monkeypatch.setattr(probe, "PIECE", piece)
    state.forget()
    scorer = make_method("kvzip").scorer
    tokenizer = StubTokenizer()
    repeat = tokenizer.encode("\n\nRepeat the previous context exactly.") + tokenizer.encode("\n") + ids.tolist()
    cache = DynamicCache()
    with torch.no_grad():
        first = eager(input_ids=ids[None], past_key_values=cache, use_cache=True)
        again = eager(input_ids=torch.tensor([repeat]), past_key_values=first.past_key_values, output_attentions=True,
                      position_ids=torch.arange(N, N + len(repeat))[None])
    with timings.collect() as spent:
        scores = [scorer.scores(state, layer) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        maps = again.attentions[layer][0, :, :, :N].float()  # [Q, t, n]: one chunk sees every prompt entry
        expected = maps.view(KV, GROUP * len(repeat), N).max(1).values
        expected[:, :4] = 1.0
        assert torch.allclose(scores[layer], expected[:, : N - 32], atol=1e-5)
    assert spent.seconds[(RECONSTRUCTION, "")] > 0  # the pass is timed as its own phase, once


@pytest.mark.parametrize("piece", [512, 2])
def test_oracle_scores_are_the_attention_the_answer_pays(setup, piece, monkeypatch):
    model, eager, ids, state, out = setup
    monkeypatch.setattr(probe, "PIECE", piece)
    state.forget()
    scorer = make_method("oracle").scorer
    question, answer = reference_answer(state)
    tail = question + answer
    with torch.no_grad():
        whole = eager(input_ids=torch.cat([ids, torch.tensor(tail)])[None], output_attentions=True)
    for layer in range(LAYERS):
        maps = whole.attentions[layer][0, :, N + len(question):, :N].float()  # answer rows over the prompt
        expected = maps.sum(1).view(KV, GROUP, N).mean(1)
        assert torch.allclose(scorer.scores(state, layer), expected, atol=1e-5)


def test_oracle_outside_eval_is_one_clear_error(setup):
    model, _, ids, _, _ = setup
    state = prefill(model, ids)
    with pytest.raises(UserError, match="full cache's answer"):
        make_method("oracle").compress(state, 40)


@pytest.mark.parametrize("budget", [16, 40, 100])
@pytest.mark.parametrize("spec", ["criticalkv", "criticaladakv", "keydiff", "expected-attention", "defensivekv",
                                  "layer-defensivekv", "kvzip", "kvzip:chunk=50", "oracle",
                                  "pyramidkv:split=adakv:scorer=criticalkv", "cake:split=adakv:scorer=defensivekv",
                                  "layer-defensivekv:split=even"])
def test_new_methods_keep_exactly_snapkvs_total(setup, spec, budget):
    _, _, _, state, _ = setup
    method, snapkv = make_method(spec), make_method("snapkv")
    built = method.compress(state, budget)
    kept = np.array([layer.counts.tolist() for layer in built])
    assert (kept == method.budgets(state, budget)).all()
    assert kept.sum() == sum(int(layer.counts.sum()) for layer in snapkv.compress(state, budget)) == LAYERS * KV * budget
    assert kept.max() <= N


def test_global_budgets_follow_the_scores_across_layers(setup):
    _, _, _, state, _ = setup
    method = make_method("layer-defensivekv")
    counts = method.budgets(state, 40)
    scorer = method.scorer
    # the entries kept beyond the windows are (up to rounding to integer budgets) the top of all layers together
    pooled = torch.cat([scorer.scores(state, layer).reshape(-1) for layer in range(LAYERS)])
    spare = LAYERS * KV * (40 - 32)
    threshold = torch.topk(pooled, spare).values[-1]
    wins = [int((scorer.scores(state, layer) >= threshold).sum()) for layer in range(LAYERS)]
    extra = (counts - 32).sum(1)
    assert np.abs(extra - np.array(wins)).max() <= KV * 1 + 1
    assert len(set(extra.tolist())) > 1  # layers do differ


def test_compositions_split_layer_budgets_by_heads(setup):
    _, _, _, state, _ = setup
    multipliers = (2.0, 1.0, 0.5, 0.5)
    composed = make_method("ripplekv:split=adakv:scorer=criticalkv", multipliers=multipliers)
    layer_only = make_method("ripplekv:scorer=criticalkv", multipliers=multipliers)
    counts = composed.budgets(state, 48)
    assert counts.sum(1).tolist() == [KV * b for b in layer_only.layer_budgets(LAYERS, 48, N)]
    assert bool((counts != counts[:, :1]).any())  # heads differ
    # the uniform layer level with AdaKV's head split is CriticalAdaKV; with SnapKV scores it is AdaKV itself
    assert (make_method("uniform:split=adakv:scorer=criticalkv").budgets(state, 48)
            == make_method("criticaladakv").budgets(state, 48)).all()
    assert (make_method("snapkv:split=adakv").budgets(state, 48) == make_method("adakv").budgets(state, 48)).all()
    assert composed.describe()["allocator"] == {"name": "file", "split": "adakv", "multipliers": list(multipliers)}


@pytest.mark.parametrize("spec, message", [
    ("snapkv:split=tokens", "option split must be one of adakv, even"),
    ("adakv:split=adakv", "splits heads itself"),
    ("snapkv:head_alpha=0.3", "head_alpha only applies with split=adakv"),
    ("snapkv:split=adakv:head_alpha=2", "head_alpha must be in"),
    ("criticalkv:first_stage_ratio=1.5", "first_stage_ratio must be in"),
    ("expected-attention:n_sink=40", "n_sink must be at most"),
])
def test_composition_mistakes_are_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        make_method(spec)


def test_requirements_name_the_signals():
    assert QUERY_STATISTICS in make_method("expected-attention").requirements().signals
    assert QUERY_STATISTICS not in make_method("snapkv").requirements().signals
    assert make_method("uniform:split=adakv:scorer=expected-attention").requirements() == Requirements(
        0, {QUERY_STATISTICS})


@pytest.mark.slow
def test_eval_runs_the_new_methods_and_reports_the_oracle_as_a_ceiling(tiny_model_dir, tmp_path, run_cli):
    """Context-only (the question read through each cache after compression; the oracle's answer follows it)."""
    import json

    import pandas as pd

    specs = ["full", "snapkv", "oracle", "expected-attention", "kvzip", "ripplekv:scorer=criticalkv:split=adakv"]  # a label sorts its options
    allocation = tmp_path / "alloc.csv"
    allocation.write_text("layer,multiplier\n0,1.5\n1,1.0\n2,0.75\n3,0.75\n")
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", ",".join(specs), "--allocation", str(allocation),
                           "--budget", "40", "--batch-size", "6", "--protocol", "context-only", "--out", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    compressed = [r for r in rows if r["method"] != "full"]
    assert {r["method"] for r in compressed} == set(specs[1:])
    assert len({r["kept_entries"] for r in compressed}) == 1 == len({r["compressed_tokens"] for r in rows})
    board = pd.read_csv(out / "leaderboard.csv")
    oracle = board[board["method"] == "oracle"].iloc[0]
    assert pd.isna(oracle["rank"]), "a ceiling is reported beside the ranking, never in it"
    assert board[(board["method"] != "oracle") & (board["method"] != "full")]["rank"].notna().all()
    assert "headroom" not in board.columns  # a score gap to the best of noisy means overclaims (#42)


def test_the_new_scorers_are_route_candidates(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from ripplekv.pipeline.profile import split_prompt
    from ripplekv.pipeline.route import RouteSettings, candidate_methods, preference_prompt

    names = ("snapkv", "criticalkv", "keydiff", "expected-attention", "snapkv:scorer=defensivekv", "snapkv:scorer=kvzip")
    # (defensivekv splits by head and kvzip spreads over layers: a route keeps a method's scorer, so it is named)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # KVzip finds the tokenizer beside it
    sample = split_prompt("s", prompt(150).tolist(), 12)
    settings = RouteSettings(methods=names, budget=40, probe_tokens=12, batch_size=8)
    kl = preference_prompt(model, sample, candidate_methods(names), settings)
    assert kl.shape == (4, len(names)) and bool((kl > 0).all())
    with pytest.raises(UserError, match="answer-aware"):
        candidate_methods(["snapkv", "oracle"])


def test_inspect_runs_a_new_method_and_refuses_the_oracle_in_one_line(tiny_model_dir, tmp_path, run_cli):
    common = ["--model", str(tiny_model_dir), "--task", "niah", "--target-tokens", "300", "--budget", "32"]
    code, _, err = run_cli("inspect", "--method", "expected-attention", "--out", str(tmp_path / "a"), *common)
    assert code == 0, err
    assert (tmp_path / "a" / "kept.npz").is_file()
    code, _, err = run_cli("inspect", "--method", "oracle", "--out", str(tmp_path / "b"), *common)
    assert code == 2 and "full cache's answer" in err and "Traceback" not in err


@pytest.mark.parametrize("earlier", [0, 7, 90])  # new tokens alone, or after some of the cache
@pytest.mark.parametrize("subset", [(), ((0, 3), (20, 60), (90, 10**9))])  # none apart, or sinks, a chunk, the new
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_right_attention_is_sdpa_with_the_causal_mask(earlier, subset, dtype):
    """The probing pass's CPU attention (flash calls merged) equals sdpa over the lower-right causal mask, and its
    log-sum-exp is the softmax normaliser over the keys in `subset` (clipped to the earlier keys) and the new ones."""
    generator = torch.Generator().manual_seed(earlier)
    new, groups = 9, 3
    query = torch.randn(1, 2 * groups, new, D, generator=generator).to(dtype)
    key, value = (torch.randn(1, 2, earlier + new, D, generator=generator).to(dtype) for _ in range(2))
    mask = torch.ones(new, earlier + new, dtype=torch.bool)
    mask[:, earlier:] = torch.ones(new, new, dtype=torch.bool).tril()
    got, normaliser = probe.lower_right_attention(query, key, value, 0.25, subset=subset)
    wide_key, wide_value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    want = F.scaled_dot_product_attention(query, wide_key, wide_value, attn_mask=mask[None, None], scale=0.25)
    assert got.shape == (1, new, 2 * groups, D) and got.dtype == dtype
    assert torch.allclose(got.float(), want.transpose(1, 2).float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    apart = torch.zeros(earlier + new, dtype=torch.bool)
    for lo, hi in subset:
        apart[lo:min(hi, earlier)] = True
    logits = (query.float() @ wide_key.float().transpose(-1, -2)) * 0.25
    logits = logits.masked_fill(~(mask & (apart | (torch.arange(earlier + new) >= earlier))), float("-inf"))
    assert normaliser.shape == (1, 2 * groups, new)
    assert torch.allclose(normaliser, torch.logsumexp(logits, -1), atol=1e-5 if dtype == torch.float32 else 1e-2)
    alone = probe.lower_right_attention(query, key, value, 0.25, subset=subset, output=False)
    assert alone[0] is None and torch.equal(alone[1], normaliser)  # the normaliser without the output, bit for bit


def test_the_split_attention_runs_on_one_cpu_sequence_of_a_full_layer_only():
    """A sliding-window layer (its mask is not lower-right causal) and batches keep sdpa with the model's mask."""
    module = torch.nn.Module()
    module.sliding_window = None
    assert probe.can_split_attention(module, torch.zeros(1, 4, 3, D))
    assert not probe.can_split_attention(module, torch.zeros(2, 4, 3, D))
    module.sliding_window = 4
    assert not probe.can_split_attention(module, torch.zeros(1, 4, 3, D))


@pytest.mark.parametrize("skip_template", [0, 1])
def test_kvzip_scores_from_the_flash_normaliser_equal_their_own_softmax(skip_template, monkeypatch, tokenizer):
    """KVzip's CPU path (scores from the merged flash attentions' log-sum-exp) against its sdpa path (the scores'
    own softmax), over chunks of 50 with sinks and pieces of 13, the template skipped or not."""
    from ripplekv.methods import kvzip

    model = tiny_llama(vocab_size=len(tokenizer), seed=2)
    ids = torch.randint(200, 5000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    state = satisfy(prefill(model, ids, requirements=Requirements.of_all([make_method("kvzip")])), tokenizer)
    monkeypatch.setattr(probe, "PIECE", 13)
    split = kvzip.reconstruct(state, 4, 50, skip_template)
    monkeypatch.setattr(kvzip, "can_split_attention", lambda module, query: False)
    softmax = kvzip.reconstruct(state, 4, 50, skip_template)
    assert (split[..., 40:] > 0).all() and (split[..., 40:] < 1).all()  # every entry past the template scored
    assert torch.allclose(split, softmax, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("split", [True, False])
def test_kvzip_pass_stops_at_the_last_layers_attention(split, monkeypatch, tokenizer):
    """Nothing after the last layer's attention feeds the scores: that layer's MLP never runs, every earlier one
    runs on each piece, and the last layer is still scored (its scores against the attention maps: the test of
    the repeat pass above)."""
    from ripplekv.methods import kvzip

    model = tiny_llama(vocab_size=len(tokenizer), seed=2)
    ids = torch.randint(200, 5000, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    state = satisfy(prefill(model, ids, requirements=Requirements.of_all([make_method("kvzip")])), tokenizer)
    monkeypatch.setattr(probe, "PIECE", 13)
    if not split:
        monkeypatch.setattr(kvzip, "can_split_attention", lambda module, query: False)
    ran = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda module, args, out, index=index: ran.__setitem__(index, ran[index] + 1))
    scores = kvzip.reconstruct(state, 4, 50, 0)
    assert ran[-1] == 0 and min(ran[:-1]) > 1 and len(set(ran[:-1])) == 1
    assert (scores[-1, :, 4:] > 0).all() and (scores[-1] <= 1).all()

