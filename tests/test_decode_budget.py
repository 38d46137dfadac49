"""`--decode-budget total`: every head holds exactly its count at every decoding step, and H2O's decoding-phase
eviction equals an independent eager implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ripplekv.engine.budgeted import decode_in_budget
from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import forward_tokens, full_reference, greedy_decode
from ripplekv.engine.evict import attach, capacities, peak_entries
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from ripplekv.pipeline.eval_plan import EvalSettings, check_decode_budget
from tests.conftest import every_method, tiny_llama

DECODING = ("snapkv", "pyramidkv", "adakv", "ripplekv", "streamingllm", "h2o", "tova")


def prompt(length, vocab=101, seed=1):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def forced_logprobs(model, state, variants, policy, caps, tokens, on_step=None) -> torch.Tensor:
    """Log-probs [V, T, vocab] along `tokens`, fed one per step through evicting caches of these variants alone
    (what `decode_in_budget`'s forced rows must equal); `on_step(cache, step)` sees the cache after each step."""
    cache = build_cache(state, variants)
    attach(cache, state, variants, policy, caps)
    rows = [torch.log_softmax(state.last_logits, -1)[None].expand(cache.num_variants, -1)]
    for step, token in enumerate(tokens[:-1]):
        fed = torch.full((cache.num_variants, 1), int(token), dtype=torch.long, device=state.device)
        rows.append(torch.log_softmax(forward_tokens(model, cache, fed, state.length + step, logits_to_keep=1)[:, -1], -1))
        if on_step is not None:
            on_step(cache, step + 1)
    return torch.stack(rows, dim=1)


def decode_keeping(model, state, built, policy, caps, steps):
    """Greedy decoding with evictors attached; returns (tokens, the cache it decoded with)."""
    caches = []

    def prepare(cache):
        attach(cache, state, built, policy, caps)
        caches.append(cache)

    return greedy_decode(model, state, built, steps, prepare=prepare), caches[0]


def held_by_bias(layer) -> torch.Tensor:
    """[V, H] entries the attention can see: finite prompt bias plus finite decoded bias."""
    seen = torch.isfinite(layer.prompt_bias).sum(-1)
    if layer.decoded_bias is not None:
        seen = seen + torch.isfinite(layer.decoded_bias).sum(-1)
    return seen


def holds_exactly(name, counts, caps, budget, seen_steps):
    """A check after every step: each head holds min(prompt count + step, capacity), the attention sees exactly
    those entries, and the variant's total is L x H_kv x B once the heads are full."""
    layers, heads = counts.shape

    def check(cache, step):
        for layer_idx, layer in enumerate(cache.layers):
            expected = torch.as_tensor(np.minimum(counts[layer_idx] + step, caps[layer_idx]))
            assert torch.equal(layer.evictor.held_counts()[0], expected), (name, step, layer_idx)
            assert torch.equal(held_by_bias(layer)[0], expected), (name, step, layer_idx)
        total = sum(int(layer.evictor.held_counts().sum()) for layer in cache.layers)
        assert total == min(layers * heads * budget, int(counts.sum()) + step * layers * heads)
        seen_steps.append(step)

    return check


@pytest.mark.slow
@pytest.mark.parametrize("length,budget,steps", [(100, 16, 210), (30, 40, 40)])
def test_every_head_holds_its_count_at_every_step(tmp_path, length, budget, steps):
    """210 decoded tokens: after every step each (layer, KV head) holds exactly its capacity (or its prompt count
    plus the tokens fed, while that is smaller), the attention sees exactly those entries, and every method's
    total is L x H_kv x B. With n < B (30 < 40) heads grow to B, then hold."""
    model = tiny_llama()
    state = prefill(model, prompt(length), capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    methods = every_method(state.num_layers, tmp_path, kv_heads=state.num_kv_heads)
    answer = full_reference(model, state, steps + 1).tokens
    assert len(answer) == steps + 1
    for name in DECODING:
        method = methods[name]
        counts = method.budgets(state, budget)
        caps = capacities(counts, budget)
        assert caps.sum() == state.num_layers * state.num_kv_heads * budget
        policy = method.decode_policy(4 if name != "snapkv" else 1)
        built = [method.compress(state, budget)]
        seen_steps = []
        logprobs = forced_logprobs(model, state, built, policy, [caps], answer,
                                   on_step=holds_exactly(name, counts, caps, budget, seen_steps))
        assert seen_steps == list(range(1, steps + 1)) and logprobs.shape[:2] == (1, steps + 1)
        assert torch.isfinite(logprobs).all()
        tokens, cache = decode_keeping(model, state, built, policy, [caps], 41)
        assert len(tokens[0]) == 41
        for layer_idx, layer in enumerate(cache.layers):  # after greedy decoding too: exactly the capacity
            assert torch.equal(layer.evictor.held_counts()[0], torch.as_tensor(caps[layer_idx]))
        assert peak_entries(counts, steps, caps) == budget


def test_a_budget_nothing_needs_evicting_under_decodes_as_prompt_budgets(tmp_path):
    """B >= n + answer: no head is ever over its capacity, so total gives plain greedy decoding's tokens."""
    model = tiny_llama()
    state = prefill(model, prompt(40), capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    methods = every_method(state.num_layers, tmp_path, kv_heads=state.num_kv_heads)
    reference = full_reference(model, state, 30)
    for name in ("snapkv", "h2o", "tova", "streamingllm"):
        method = methods[name]
        built = [method.compress(state, 80)]
        caps = [capacities(method.budgets(state, 80), 80)]
        tokens, quality = decode_in_budget(model, state, built, method.decode_policy(3), caps, reference, 30)
        assert tokens == greedy_decode(model, state, built, 30)
        assert quality[0].agreement == 1.0 and quality[0].kl < 1e-6


@pytest.mark.slow
def test_small_budgets_evict_so_answers_change(tmp_path):
    """The eviction is real: at B=8 over 60 steps some method's greedy answer leaves the prompt-budget one."""
    model = tiny_llama()
    state = prefill(model, prompt(100), capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    methods = every_method(state.num_layers, tmp_path, kv_heads=state.num_kv_heads)
    reference = full_reference(model, state, 60)
    changed = 0
    for name in ("snapkv", "h2o", "tova", "streamingllm"):
        method = methods[name]
        built = [method.compress(state, 8)]
        tokens, _ = decode_in_budget(model, state, built, method.decode_policy(1), [capacities(method.budgets(state, 8), 8)],
                                     reference, 60)
        changed += tokens != greedy_decode(model, state, built, 60)
    assert changed >= 1


@pytest.mark.slow
def test_methods_decoding_in_one_batch_equal_each_decoded_alone(tmp_path):
    """Variants of four methods (four policies) in one batch, each fed twice (greedy and along the full answer),
    give every variant the tokens of its own greedy decoding with evictors and the fidelity of its own
    one-token-at-a-time forced pass, each run alone."""
    from ripplekv.engine.decode import fidelity

    model = tiny_llama()
    state = prefill(model, prompt(100), capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    methods = every_method(state.num_layers, tmp_path, kv_heads=state.num_kv_heads)
    reference = full_reference(model, state, 50)
    names, budgets = ("snapkv", "h2o", "tova", "streamingllm"), (8, 16)
    variants = [(methods[name], budget) for name in names for budget in budgets]
    built = [method.compress(state, budget) for method, budget in variants]
    caps = [capacities(method.budgets(state, budget), budget) for method, budget in variants]
    policies = [method.decode_policy(3) for method, _ in variants]
    tokens, quality = decode_in_budget(model, state, built, policies, caps, reference, 50, batch_size=5)
    for index, policy in enumerate(policies):
        alone, _ = decode_keeping(model, state, [built[index]], policy, [caps[index]], 50)
        assert tokens[index] == alone[0], variants[index]
        forced = forced_logprobs(model, state, [built[index]], policy, [caps[index]], reference.tokens)
        (expected,) = fidelity(reference.logprobs, forced, reference.tokens)
        assert quality[index].agreement == pytest.approx(expected.agreement, abs=1e-6)
        assert quality[index].kl == pytest.approx(expected.kl, rel=1e-4, abs=1e-7)
    assert len({tuple(t) for t in tokens}) > 1  # the budgets and policies really differ


# --------------------------------------------------------------------------- H2O against an eager reference


class EagerH2O:
    """H2O decoding written from the paper, independent of ripplekv's engine: full K/V in a DynamicCache,
    eager attention with a per-KV-head mask of held entries, accumulated attention, and after each step the
    lowest accumulated score outside the `floor(count / 2)` most recent held entries leaves."""

    def __init__(self, budget: int):
        self.budget, self.recent = budget, budget // 2
        self.held, self.acc = {}, {}

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        kv_heads, length = key.shape[1], key.shape[2]
        group = query.shape[1] // kv_heads
        new = query.shape[2]
        scores = torch.matmul(query.float(), key.float().repeat_interleave(group, 1).transpose(-1, -2)) * scaling
        causal = torch.arange(length)[None, :] <= torch.arange(length - new, length)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        if new == 1:  # a decoding step: only held entries (and the new token) are visible
            held = torch.cat([self.held[layer], torch.ones(kv_heads, 1, dtype=torch.bool)], 1)
            scores = scores.masked_fill(~held.repeat_interleave(group, 0)[None, :, None, :], float("-inf"))
        weights = torch.softmax(scores, -1)
        column = weights[0].sum(1).view(kv_heads, group, length).mean(1)  # [H_kv, S]
        if new > 1:  # the prompt: heavy hitters + recent tokens
            self.acc[layer] = column
            mask = torch.zeros(kv_heads, length, dtype=torch.bool)
            mask[:, length - self.recent :] = True
            heavy = torch.topk(column[:, : length - self.recent], self.budget - self.recent, -1).indices
            self.held[layer] = mask.scatter(1, heavy, True)
        else:
            self.acc[layer] = torch.cat([self.acc[layer], torch.zeros(kv_heads, 1)], 1) + column
            for head in range(kv_heads):
                places = held[head].nonzero().flatten()
                candidates = places[: len(places) - self.recent]
                victim = candidates[torch.argmin(self.acc[layer][head, candidates])]
                held[head, victim] = False
            self.held[layer] = held
        out = torch.matmul(weights.to(value.dtype), value.repeat_interleave(group, 1))
        return out.transpose(1, 2).contiguous(), None

    def decode(self, model, ids, steps: int) -> list[int]:
        AttentionInterface.register("eager_h2o_test", self.attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register("eager_h2o_test", sdpa_mask)  # the mask is built, then ignored
        model.set_attn_implementation("eager_h2o_test")
        cache = DynamicCache()
        with torch.no_grad():
            logits = model(input_ids=ids[None], past_key_values=cache, use_cache=True).logits
            tokens = [int(logits[0, -1].argmax())]
            for _ in range(steps - 1):
                logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits
                tokens.append(int(logits[0, -1].argmax()))
        return tokens


@pytest.mark.parametrize("budget", [12, 20])
def test_decoding_phase_h2o_equals_an_eager_implementation(budget):
    ids = prompt(90, seed=4)
    reference = EagerH2O(budget)
    expected = reference.decode(tiny_llama(initializer_range=0.3), ids, 80)
    model = tiny_llama(initializer_range=0.3)
    state = prefill(model, ids, capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    method = make_method("h2o")
    built = [method.compress(state, budget)]
    caps = [capacities(method.budgets(state, budget), budget)]
    tokens, cache = decode_keeping(model, state, built, method.decode_policy(1), caps, 80)
    assert tokens[0] == expected
    for layer_idx, layer in enumerate(cache.layers):
        evictor = layer.evictor
        for head in range(state.num_kv_heads):
            ours = set(evictor.positions[0, head][evictor.held[0, head]].tolist())
            # Both fed 79 tokens (the last generated token is never fed).
            theirs = set(reference.held[layer_idx][head].nonzero().flatten().tolist())
            assert ours == theirs, (layer_idx, head)


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize("name", ["knorm", "gracekv", "oracle", "kvzip", "criticalkv", "h2o:norm=mean", "random"])
def test_methods_that_cannot_evict_while_decoding_are_refused_in_one_line(name, tmp_path):
    methods = [make_method("full"), make_method("snapkv"), make_method(name)]
    settings = EvalSettings(budgets=(64,), decode_budget="total")
    with pytest.raises(UserError, match="cannot compress while decoding"):
        check_decode_budget(settings, methods)


def test_decode_budget_settings_are_checked_and_recorded():
    methods = [make_method(n) for n in ("full", "snapkv", "h2o", "tova", "streamingllm", "pyramidkv", "adakv")]
    assert check_decode_budget(EvalSettings(budgets=(64,)), methods) == {}
    assert check_decode_budget(EvalSettings(budgets=(64,), decode_budget="total"), methods) == \
        {"decode_budget": "total", "compress_every": 8}
    for bad, message in ((dict(decode_budget="both"), "--decode-budget must be one of"),
                         (dict(compress_every=4), "applies only with --decode-budget total"),
                         (dict(decode_budget="total", compress_every=0), "positive integer"),
                         (dict(decode_budget="total", protocol="context-only"), "with-question only")):
        with pytest.raises(UserError, match=message):
            check_decode_budget(EvalSettings(budgets=(64,), **bad), methods)


@pytest.mark.slow
def test_inspect_under_a_total_budget_saves_what_each_head_holds_after_the_answer(tiny_model_dir, tmp_path, run_cli):
    import json

    out = tmp_path / "inspect"
    common = ["inspect", "--model", str(tiny_model_dir), "--task", "niah", "--budget", "32", "--target-tokens", "300"]
    code, _, err = run_cli(*common, "--method", "h2o", "--decode-budget", "total", "--out", str(out))
    assert code == 0, err
    kept = np.load(out / "kept.npz")
    meta = json.loads(str(kept["meta"]))
    n, fed = meta["prompt_tokens"], meta["decoded_tokens"]
    assert meta["decode_budget"] == "total" and fed > 0
    assert (kept["counts"] == 32).all()  # the budget holds at the end of the answer
    positions = kept["positions"]
    assert ((positions >= 0) & (positions < n + fed)).sum() == 4 * 2 * 32
    assert (positions >= n).any()  # decoded tokens are among the entries held
    code, _, err = run_cli(*common, "--method", "knorm", "--decode-budget", "total", "--out", str(tmp_path / "no"))
    assert code == 2 and "knorm cannot compress while decoding" in err
    code, _, err = run_cli(*common, "--method", "snapkv", "--compress-every", "2", "--out", str(tmp_path / "no2"))
    assert code == 2 and "--compress-every applies only" in err
