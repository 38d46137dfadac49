"""Finch, KVgrad and SimLayerKV, each against its formula computed another way on a tiny model: the model's own
eager attention maps (Finch, SimLayerKV) and kvpress's route to KVgrad's gradients (hooks that retain the attention
outputs' gradients, `.backward()`, queries re-projected from the hidden states); then exact totals in an eval."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.recorders import SampleContext
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.finch import finch_scores
from ripplekv.methods.kvgrad import gradient_scores
from ripplekv.methods.kvzip import FIRST_REQUEST, LATER_REQUEST, OVERLAP, TOKENIZER
from ripplekv.methods.simlayerkv import Laziness, lazy_layers
from tests.conftest import StubTokenizer, tiny_llama

N, QUESTION = 90, 12


def prompt(length: int = N, seed: int = 4) -> torch.Tensor:
    return torch.randint(3, 101, (length,), generator=torch.Generator().manual_seed(seed))


def eager_attentions(ids: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    """The model's own softmax attention [H_q, n, n] per layer (float32, eager), from a copy of the tiny model."""
    model = tiny_llama(seed=seed)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids[None], output_attentions=True)
    return [layer[0].float() for layer in out.attentions]


def test_finch_is_the_question_attention_times_keys_seen_and_keeps_the_question():
    ids = prompt()
    maps = eager_attentions(ids)
    start = N - QUESTION
    method = make_method("finch")
    state = prefill_for(tiny_llama(), ids, method.requirements(), context=SampleContext(question_at=start))
    group = maps[0].shape[0] // state.num_kv_heads
    for layer, attention in enumerate(maps):
        rows = attention[:, start:, :start] * torch.arange(start, N, dtype=torch.float32)[None, :, None]
        expected = rows.mean(1).view(state.num_kv_heads, group, start).mean(1)
        assert torch.allclose(finch_scores(state, layer, True), expected, rtol=1e-4, atol=1e-6)
        plain = attention[:, start:, :start].mean(1).view(state.num_kv_heads, group, start).mean(1)
        assert torch.allclose(finch_scores(state, layer, False), plain, rtol=1e-4, atol=1e-6)
    budget = 40
    kept = method.select(state, budget)
    assert int(kept.sum()) == state.num_layers * state.num_kv_heads * budget
    for layer, attention in enumerate(maps):
        expected = (attention[:, start:, :start] * torch.arange(start, N)[None, :, None]).mean(1)
        expected = expected.view(state.num_kv_heads, group, start).mean(1)
        top = torch.sort(expected, dim=-1, descending=True, stable=True).indices[:, : budget - QUESTION]
        assert kept[layer, :, start:].all()  # the whole question part
        assert all(set(torch.nonzero(kept[layer, h, :start]).flatten().tolist()) == set(top[h].tolist())
                   for h in range(state.num_kv_heads))
    short = method.select(state, 8)  # fewer than the question: its last tokens
    assert short[..., N - 8:].all() and int(short.sum()) == state.num_layers * state.num_kv_heads * 8


def test_finch_refuses_a_prompt_without_a_question_part_in_one_line():
    method = make_method("finch")
    for context in (SampleContext(), SampleContext(question_at=N), SampleContext(question_at=0)):
        state = prefill_for(tiny_llama(), prompt(), method.requirements(), context=context)
        with pytest.raises(UserError, match="finch needs the question inside the compressed prompt") as caught:
            method.compress(state, 40)
        assert "\n" not in str(caught.value)


def shares(maps, n_last, n_recent, n_initial):
    """SimLayerKV's test per layer from the eager maps: the last n_last rows over the keys before them, averaged over
    rows and heads, summed over the first n_initial and the last n_recent of them."""
    out = []
    for attention in maps:
        n = attention.shape[-1]
        mass = attention[:, n - n_last:, : n - n_last].mean(dim=(0, 1))
        out.append(float(mass[:n_initial].sum() + mass[-n_recent:].sum()))
    return out


def test_simlayerkv_lazy_layers_and_both_readings():
    ids = prompt(N, seed=7)
    maps = eager_attentions(ids)
    options = {"n_last": 1, "n_recent": 20, "n_initial": 2}
    by_hand = shares(maps, **options)
    threshold = sorted(by_hand)[1] + 1e-4  # the lowest two layers are not lazy, the others are
    lazy = [share > threshold for share in by_hand]
    assert 0 < sum(lazy) < len(lazy)
    spec = "simlayerkv:" + ":".join(f"{k}={v}" for k, v in {**options, "lazy_threshold": threshold}.items())
    method = make_method(spec)
    state = prefill_for(tiny_llama(), ids, method.requirements())
    assert list(lazy_layers(state, threshold, 1, 20, 2)) == lazy
    assert list(lazy_layers(state, 1.0, 1, 20, 2)) == [False] * len(lazy)  # kvpress: 1.0 turns it off
    short = prefill_for(tiny_llama(), ids[:23], method.requirements())  # n <= 2 + 20 + 1: nothing to tell apart
    assert not any(Laziness(threshold, 1, 20, 2).lazy(short))

    kvpress = make_method(spec + ":reading=threshold").select(state, 16)  # B plays no part
    for layer, flag in enumerate(lazy):
        expected = torch.ones(state.num_kv_heads, N, dtype=torch.bool)
        if flag:
            expected[:, 2:N - 19] = False  # 2 sinks and the last n_recent - n_last entries
        assert torch.equal(kvpress[layer], expected), layer

    budget, window = 48, 32
    counts = method.budgets(state, budget)
    total = state.num_layers * state.num_kv_heads * budget
    assert counts.sum() == total
    rest = (state.num_layers * budget - sum(lazy) * (2 + window)) / (len(lazy) - sum(lazy))
    for layer, flag in enumerate(lazy):
        assert (counts[layer] == 2 + window).all() if flag else abs(int(counts[layer, 0]) - rest) < 1
    kept = method.select(state, budget)
    snap = make_method("snapkv").scorer
    for layer, flag in enumerate(lazy):
        if flag:
            assert kept[layer, :, :2].all() and kept[layer, :, N - window:].all()
        else:
            assert torch.equal(kept[layer], snap.keep(state, layer, torch.as_tensor(counts[layer])))
    assert torch.equal(make_method(spec.replace(f"lazy_threshold={threshold}", "lazy_threshold=1")).select(state, budget),
                       make_method("snapkv").select(state, budget))  # no lazy layer: SnapKV


def replay_by_hand(model, keys, values, tokens):
    """kvpress's replay: a copy of the prompt's cache, hooks keeping each layer's input and retaining its attention
    output's gradient, `.backward()` from the squared norm of the last layer's output. ({layer: (hidden, rope)},
    {layer: attention output with .grad})."""
    cache = DynamicCache()
    for i in range(len(keys)):
        cache.update(keys[i][None].clone(), values[i][None].clone(), i)
    inputs, outputs, last = {}, {}, []

    def attention_hook(module, args, kwargs, output):
        inputs[module.layer_idx] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])
        output[0].retain_grad()
        outputs[module.layer_idx] = output[0]

    hooks = [decoder.self_attn.register_forward_hook(attention_hook, with_kwargs=True) for decoder in model.model.layers]
    hooks.append(model.model.layers[-1].register_forward_hook(
        lambda m, a, out: last.append(out[0] if isinstance(out, tuple) else out)))
    embeds = model.model.embed_tokens(torch.tensor([tokens])).detach().requires_grad_(True)
    model.model(inputs_embeds=embeds, cache=cache, use_cache=True)
    last[-1].float().square().sum().backward()
    for hook in hooks:
        hook.remove()
    return inputs, outputs


def kvgrad_by_hand(model, ids: list[int], tokenizer, n_sink: int, chunk: int) -> torch.Tensor:
    """KVgrad's scores [L, H_kv, n] as kvpress computes them: per chunk a replay through a copy of the prompt's cache,
    queries re-projected from each layer's input, the attention outputs' gradients from `.backward()`."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("sdpa")
    config = model.config
    layers, kv_heads, heads = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads
    dim, group, n = config.head_dim, heads // kv_heads, len(ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    prompt_cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    keys = [prompt_cache.layers[i].keys[0].clone() for i in range(layers)]
    values = [prompt_cache.layers[i].values[0].clone() for i in range(layers)]
    scores = torch.zeros(layers, kv_heads, n)
    opening = tokenizer.encode("\n")
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        request = tokenizer.encode(FIRST_REQUEST if start == 0 else LATER_REQUEST)
        tokens = request + (ids[max(0, start - OVERLAP):start] if start else []) + opening + ids[start:stop]
        inputs, outputs = replay_by_hand(model, keys, values, tokens)
        count, sink = len(tokens), min(n_sink, start)
        with torch.no_grad():
            for i, decoder in enumerate(model.model.layers):
                attention = decoder.self_attn
                hidden, (cos, sin) = inputs[i]
                query = attention.q_proj(hidden).view(1, count, heads, dim).transpose(1, 2)
                new_keys = attention.k_proj(hidden).view(1, count, kv_heads, dim).transpose(1, 2)
                query, new_keys = apply_rotary_pos_emb(query, new_keys, cos, sin)
                seen = torch.cat([keys[i][:, :sink], keys[i][:, start:stop], new_keys[0]], dim=1)  # [H_kv, K, d]
                logits = query[0].view(kv_heads, group, count, dim) @ seen[:, None].transpose(-1, -2) / math.sqrt(dim)
                ahead = torch.triu(torch.ones(count, count, dtype=torch.bool), diagonal=1)
                logits[..., -count:] = logits[..., -count:].masked_fill(ahead, float("-inf"))
                weights = torch.softmax(logits, dim=-1)[..., sink:sink + stop - start]  # [H_kv, group, T, c]
                w_o = attention.o_proj.weight.view(config.hidden_size, kv_heads, group, dim)
                norms = torch.einsum("jhgi,hti->hgtj", w_o, values[i][:, start:stop]).norm(dim=-1)  # [H_kv, group, c]
                grads = outputs[i].grad[0].norm(dim=-1)  # [T]
                scores[i, :, start:stop] = (weights * norms[:, :, None, :] * grads[None, None, :, None]).amax(dim=(1, 2))
    scores[..., :n_sink] = scores.max() + 1
    return scores


def test_kvgrad_is_attention_times_value_norm_times_gradient_norm_over_each_replay():
    model = tiny_llama(seed=3)
    ids = prompt(70, seed=11).tolist()
    expected = kvgrad_by_hand(model, ids, StubTokenizer(), 4, 32)
    state = prefill_for(model, ids, Requirements(signals={TOKENIZER}), context=SampleContext(tokenizer=StubTokenizer()))
    scores = gradient_scores(state, 4, 32)
    assert torch.allclose(scores, expected, rtol=1e-3, atol=1e-6)
    assert (scores[..., 4:] > 0).all()
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())  # no parameter gradient formed
    one_chunk = gradient_scores(state, 4, 512)
    assert not torch.allclose(one_chunk, scores)  # the chunks replay different requests
    method = make_method("kvgrad:chunk=32")
    counts = method.budgets(state, 40)
    assert counts.sum() == state.num_layers * state.num_kv_heads * 40
    assert torch.stack([layer.counts for layer in method.compress(state, 40)]).sum() == counts.sum()


@pytest.mark.slow
def test_an_eval_keeps_as_many_entries_with_each_as_with_snapkv(tiny_model_dir):
    """One eval sample of hotpotqa: snapkv, finch, kvgrad and simlayerkv (both lazy and not, n_recent 64) keep
    exactly L x H_kv x B; finch's window is the sample's own question part; context-only refuses finch."""
    from ripplekv.engine.models import load_model
    from ripplekv.pipeline import evaluate
    from ripplekv.tasks import get_tasks, load_samples

    model, tokenizer, _ = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    task = get_tasks("offline", ["hotpotqa"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=300)[0]
    names = ["snapkv", "finch", "kvgrad", "simlayerkv:n_recent=64:lazy_threshold=0.5", "simlayerkv"]
    methods = {name: make_method(name) for name in names}
    rows = evaluate.evaluate_sample(model, tokenizer, task, record, methods, [64], evaluate.SampleSettings(batch_size=4),
                                    sid="s")
    kept = {row["method"]: row["kept_entries"] for row in rows if row["method"] != "full"}
    assert set(kept) == set(names) and len(set(kept.values())) == 1
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert kept["snapkv"] == layers * heads * 64
    context_only = evaluate.SampleSettings(batch_size=4, protocol="context-only")
    with pytest.raises(UserError, match="finch needs the question"):
        evaluate.evaluate_sample(model, tokenizer, task, record, {"finch": methods["finch"]}, [64], context_only, sid="s")
