"""The engine against the model itself: full cache = the model's own output; batched = one at a time."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from ripplekv.engine import entries
from ripplekv.engine.cache import CompressedLayer, build_cache, compressed_attention
from ripplekv.engine.decode import fidelity, greedy_decode, teacher_forced_logprobs
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.methods import AllocatorScorer, make_method
from tests.conftest import every_method, satisfy


def prompt(length=120, vocab=101, seed=1):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def reference_greedy(model, ids, steps):
    """The model's own greedy output with its stock attention and cache."""
    stock = copy.deepcopy(model)
    out = stock.generate(ids[None], max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_prefill_logits_are_the_models_own(tiny_model):
    ids = prompt()
    expected = copy.deepcopy(tiny_model)(ids[None]).logits[0, -1]
    state = prefill(tiny_model, ids, capture_window=16)
    assert torch.allclose(state.last_logits, expected, atol=1e-5)
    assert state.keys[0].shape == (2, 120, 16) and state.window_queries[0].shape == (4, 16, 16)


def test_full_cache_and_budget_above_n_reproduce_the_model(tiny_model):
    ids = prompt()
    expected = reference_greedy(tiny_model, ids, 15)
    state = prefill(tiny_model, ids, capture_window=32)
    assert greedy_decode(tiny_model, state, None, 15)[0] == expected
    methods = [make_method(name) for name in ("snapkv", "pyramidkv", "streamingllm")]
    assert all(m.select(state, 500).all() for m in methods)
    variants = [m.compress(state, 500) for m in methods]
    # A budget >= n keeps every layer whole: the prefill's own tensors, shared, not copies.
    assert all(layer is state.full_entries(i) for v in variants for i, layer in enumerate(v))
    assert greedy_decode(tiny_model, state, variants, 15) == [expected] * 3
    # Teacher-forced log-probs of the full cache equal one forward pass of prompt + answer.
    stock = copy.deepcopy(tiny_model)
    logits = stock(torch.cat([ids, torch.tensor(expected[:-1])])[None]).logits[0, len(ids) - 1 :]
    ours = teacher_forced_logprobs(tiny_model, state, None, expected)[0]
    assert torch.allclose(ours, torch.log_softmax(logits, -1), atol=1e-5)


def test_compressed_decode_matches_stock_model_on_the_kept_entries(tiny_model):
    """Reference: the stock model and DynamicCache holding only the kept K/V, positions continuing at n."""
    ids = prompt(150)
    state = prefill(tiny_model, ids, capture_window=32)
    method = make_method("pyramidkv", window=8)  # per-layer lengths differ
    mask = method.select(state, 40)
    ours = greedy_decode(tiny_model, state, [method.compress(state, 40)], 10)[0]
    stock = copy.deepcopy(tiny_model)
    stock.set_attn_implementation("sdpa")
    cache = DynamicCache(config=stock.config)
    for layer in range(state.num_layers):
        # Same count in every head of a layer, different entries per head: gather head by head.
        kept = [mask[layer, h].nonzero().flatten() for h in range(state.num_kv_heads)]
        keys = torch.stack([state.keys[layer][h, k] for h, k in enumerate(kept)])[None]
        values = torch.stack([state.values[layer][h, k] for h, k in enumerate(kept)])[None]
        cache.update(keys, values, layer)
    tokens = [int(state.last_logits.argmax())]
    for step in range(1, 10):
        out = stock(
            input_ids=torch.tensor([[tokens[-1]]]),
            position_ids=torch.tensor([[150 + step - 1]]),
            past_key_values=cache,
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    assert ours == tokens


def test_batched_variants_decode_as_one_at_a_time(tiny_model, tmp_path):
    ids = prompt(200)
    methods = every_method(tiny_model.config.num_hidden_layers, tmp_path, kv_heads=tiny_model.config.num_key_value_heads).values()
    state = satisfy(prefill(tiny_model, ids, capture_window=64, requirements=Requirements.of_all(methods)))  # every method's needs
    # A budget under the default window (32) and one above it: each method alone is 8 decode steps, so the
    # 24 methods x 2 budgets cost 384 single-variant steps (3 budgets x 12 steps took 864, 1.5 min on 2 cores).
    # (quantization alone cannot fit a budget under its bytes: such a variant is infeasible, never decoded)
    masks = [method.compress(state, budget) for method in methods for budget in (16, 96)
             if getattr(method, "infeasible", lambda *_: None)(state, budget) is None]
    batched = greedy_decode(tiny_model, state, masks, 8)
    alone = [greedy_decode(tiny_model, state, [m], 8)[0] for m in masks]
    assert batched == alone
    full = greedy_decode(tiny_model, state, None, 8)[0]
    together = teacher_forced_logprobs(tiny_model, state, masks, full)
    for i in range(0, len(masks), 5):
        single = teacher_forced_logprobs(tiny_model, state, [masks[i]], full)[0]
        assert torch.allclose(together[i], single, atol=1e-5)


def test_finished_variants_leave_the_batch_without_changing_the_others(tiny_model):
    ids = prompt(100)
    state = prefill(tiny_model, ids, capture_window=32)
    masks = [make_method("snapkv", window=8).compress(state, b) for b in (16, 32, 64)]
    free = greedy_decode(tiny_model, state, masks, 12)
    stop = free[1][3]  # make variant 1 stop early at its 4th token
    stopped = greedy_decode(tiny_model, state, masks, 12, stop_ids=[stop])
    for plain, early in zip(free, stopped):
        cut = plain.index(stop) + 1 if stop in plain else len(plain)
        assert early == plain[:cut]


def test_decode_positions_continue_after_the_original_prompt(tiny_model):
    ids = prompt(90)
    state = prefill(tiny_model, ids, capture_window=16)
    seen = []
    rotary = tiny_model.model.rotary_emb
    original = rotary.forward

    def spy(x, position_ids=None, **kw):
        seen.append(position_ids.clone())
        return original(x, position_ids=position_ids, **kw)

    rotary.forward = spy
    try:
        greedy_decode(tiny_model, state, [make_method("streamingllm").compress(state, 20)], 4)
    finally:
        rotary.forward = original
    assert [p.flatten().tolist() for p in seen] == [[90], [91], [92]]


def test_per_head_lengths_attend_exactly_over_each_heads_entries():
    """Heads of one layer keep different counts; compare to attention computed head by head."""
    torch.manual_seed(0)
    kv_heads, group, length, dim = 2, 2, 30, 8
    keys, values = torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    mask = torch.zeros(1, kv_heads, length, dtype=torch.bool)
    mask[0, 0, [0, 3, 5, 29]] = True
    mask[0, 1, 10:29] = True

    state = SimpleNamespace(num_layers=1, length=length, keys=[keys], values=[values])
    cache = build_cache(state, [[entries.gather(keys, values, mask[0])]], None)
    layer = cache.layers[0]
    assert isinstance(layer, CompressedLayer) and layer.prompt_bias is not None
    query = torch.randn(1, kv_heads * group, 1, dim)
    new_k, new_v = torch.randn(1, kv_heads, 1, dim), torch.randn(1, kv_heads, 1, dim)
    out = compressed_attention(query, layer, new_k, new_v, dim**-0.5)  # [1, 1, H_q, d]
    for h in range(kv_heads * group):
        kv = h // group
        kept = mask[0, kv].nonzero().flatten()
        k = torch.cat([keys[kv, kept], new_k[0, kv]])
        v = torch.cat([values[kv, kept], new_v[0, kv]])
        expected = torch.softmax(query[0, h] @ k.T * dim**-0.5, -1) @ v
        assert torch.allclose(out[0, 0, h], expected[0], atol=1e-6)


@torch.inference_mode()
def test_fidelity_equals_kl_and_agreement_from_the_stock_model_on_the_kept_entries(tiny_model):
    """KL(full || variant) and agreement, recomputed with the stock model and a DynamicCache of the kept K/V."""
    from ripplekv.engine.decode import Reference, measure_fidelity

    ids = prompt(150)
    state = prefill(tiny_model, ids, capture_window=32)
    answer = greedy_decode(tiny_model, state, None, 8)[0]
    stock = copy.deepcopy(tiny_model)
    stock.set_attn_implementation("sdpa")
    full = torch.log_softmax(stock(torch.cat([ids, torch.tensor(answer[:-1])])[None]).logits[0, len(ids) - 1 :], -1)
    methods = [make_method("streamingllm"), make_method("pyramidkv", window=8)]
    ours = measure_fidelity(tiny_model, state, [m.compress(state, 40) for m in methods], Reference(answer, full))
    for method, result in zip(methods, ours):
        mask = method.select(state, 40)
        cache = DynamicCache(config=stock.config)
        for layer in range(state.num_layers):
            kept = [mask[layer, h].nonzero().flatten() for h in range(state.num_kv_heads)]
            cache.update(torch.stack([state.keys[layer][h, k] for h, k in enumerate(kept)])[None],
                         torch.stack([state.values[layer][h, k] for h, k in enumerate(kept)])[None], layer)
        rest = [stock(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[150 + step]]), past_key_values=cache,
                      use_cache=True).logits[0, -1] for step, token in enumerate(answer[:-1])]  # one at a time: layers differ in length
        variant = torch.log_softmax(torch.stack([state.last_logits, *rest]), -1)  # the first token: the prefill's
        kl = float((full.exp() * (full - variant)).sum(-1).mean())
        agreement = float((variant.argmax(-1) == torch.tensor(answer)).float().mean())
        assert kl > 0, method.label  # something was evicted: the variant's distribution moved
        assert result.kl == pytest.approx(kl, rel=1e-3, abs=1e-6) and result.agreement == agreement, method.label


def test_fidelity_of_identical_distributions_is_zero_kl_full_agreement():
    logprobs = torch.log_softmax(torch.randn(5, 11), -1)
    tokens = logprobs.argmax(-1).tolist()
    (result,) = fidelity(logprobs, logprobs[None], tokens)
    assert result.kl == pytest.approx(0.0, abs=1e-7) and result.agreement == 1.0


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_supported_families_match_their_own_output(family):
    """Qwen3 (q/k norms) and Mistral go through the same engine: full cache = the model; batched = alone."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import TINY

    torch.manual_seed(0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=101, head_dim=16, **TINY)).eval()
    else:
        model = MistralForCausalLM(MistralConfig(vocab_size=101, sliding_window=None, **TINY)).eval()
    ids = prompt(150)
    expected = reference_greedy(model, ids, 10)
    state = prefill(model, ids, capture_window=32)
    assert greedy_decode(model, state, None, 10)[0] == expected
    masks = [make_method(name).compress(state, 40) for name in ("snapkv", "pyramidkv", "streamingllm")]
    assert greedy_decode(model, state, masks, 10) == [greedy_decode(model, state, [m], 10)[0] for m in masks]


class MergeIdentical(AllocatorScorer):
    """Test-only merging method: per layer, tokens [start, start+m) are made identical (copies of `start`);
    with `merge` they are stored as ONE prototype entry of log-weight log m instead of m entries."""

    def __init__(self, start: int, m: int, merge: bool):
        super().__init__("merge-test", "merge-test", make_method("snapkv").allocator, make_method("snapkv").scorer)
        object.__setattr__(self, "span", (start, m, merge))

    def compress(self, state, budget):
        start, m, merge = self.span
        built = []
        for layer in range(state.num_layers):
            keys, values = state.keys[layer].clone(), state.values[layer].clone()
            keys[:, start : start + m] = keys[:, start : start + 1]
            values[:, start : start + m] = values[:, start : start + 1]
            keep = torch.ones(keys.shape[:2], dtype=torch.bool)
            if merge:
                keep[:, start + 1 : start + m] = False
            layer_entries = entries.gather(keys, values, keep)
            if merge:
                log_weights = torch.zeros(layer_entries.keys.shape[:2])
                log_weights[:, start] = math.log(m)
                layer_entries.log_weights = log_weights
            built.append(layer_entries)
        return built


def test_a_prototype_of_m_identical_tokens_attends_as_the_m_tokens(tiny_model):
    """Merging needs no change to the cache: one entry with log-weight log m == m identical entries."""
    ids = prompt(120)
    state = prefill(tiny_model, ids, capture_window=16)
    copies, prototype = MergeIdentical(30, 9, False), MergeIdentical(30, 9, True)
    merged = prototype.compress(state, 64)
    assert all(layer.total() == 2 * (120 - 8) for layer in merged)  # 8 entries fewer in each of 2 heads
    answer = greedy_decode(tiny_model, state, [copies.compress(state, 64)], 10)[0]
    both = teacher_forced_logprobs(tiny_model, state, [copies.compress(state, 64), merged], answer)
    assert torch.allclose(both[0], both[1], atol=1e-5)
    assert greedy_decode(tiny_model, state, [merged], 10)[0] == answer
    # Without the log-weight the prototype counts once, and attention really differs.
    for layer in merged:
        layer.log_weights = None
    plain = teacher_forced_logprobs(tiny_model, state, [merged], answer)[0]
    assert not torch.allclose(both[0], plain, atol=1e-3)


def test_context_only_protocol_reads_the_question_through_the_cache(tiny_model):
    """Prefill the context alone, feed the question through the cache: with the full cache this is exactly
    the model on the whole prompt; compressed, the question attends to the kept context entries only."""
    ids = prompt(160)
    context, question = ids[:140], ids[140:].tolist()
    expected = reference_greedy(tiny_model, ids, 12)
    state = prefill(tiny_model, context, capture_window=32)
    assert greedy_decode(tiny_model, state, None, 12, prefix=question)[0] == expected
    whole = prefill(tiny_model, ids, capture_window=32)
    full_lp = teacher_forced_logprobs(tiny_model, whole, None, expected)[0]
    ours = teacher_forced_logprobs(tiny_model, state, None, expected, prefix=question)[0]
    assert torch.allclose(ours, full_lp, atol=1e-5)
    # Budgets count the context alone; batched variants still decode as each one alone.
    variants = [make_method(name).compress(state, 40) for name in ("snapkv", "streamingllm")]
    assert all(sum(layer.total() for layer in v) == state.num_layers * state.num_kv_heads * 40 for v in variants)
    batched = greedy_decode(tiny_model, state, variants, 8, prefix=question)
    assert batched == [greedy_decode(tiny_model, state, [v], 8, prefix=question)[0] for v in variants]
