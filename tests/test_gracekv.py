"""GraceKV: RoPE alignment, exact prototypes, the global greedy's order, exact totals, full cache at B >= n;
the published form's slot DP (against brute force), curvature and both split kinds."""

import heapq
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv.engine import adapter
from ripplekv.engine.decode import greedy_decode, teacher_forced_logprobs
from ripplekv.engine.prefill import prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.gracekv.method import greedy_order
from ripplekv.methods.gracekv.slots import curvature, robust_z, segment, segment_value
from ripplekv.methods.gracekv.trees import RopeTable, distortion, summarize, unrotate
from tests.conftest import check_fidelity, tiny_llama
from tests.test_budgets import fake_state


def prompt(length, seed=0):
    return torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(seed))


def test_rope_unrotate_rerotate_round_trip(tiny_model):
    state = prefill(tiny_model, prompt(120), capture_window=32)
    keys = state.keys[1].float()
    positions = torch.arange(120).expand(keys.shape[0], -1)
    cos, sin = adapter.rope_at(tiny_model, positions, keys)
    unrotated = adapter.invert_rope(keys, cos, sin)
    assert torch.allclose(adapter.apply_rope(unrotated, cos, sin), keys, atol=1e-5)
    # Rotation keeps norms, and re-rotating at another position changes the key (RoPE is really applied).
    assert torch.allclose(unrotated.norm(dim=-1), keys.norm(dim=-1), atol=1e-4)
    cos0, sin0 = adapter.rope_at(tiny_model, torch.zeros_like(positions), keys)
    assert torch.allclose(adapter.apply_rope(unrotated, cos0, sin0), unrotated, atol=1e-6)


def attend(query, keys, values, bias):
    weights = torch.softmax(query @ keys.T + bias, -1)
    return weights @ values


def test_prototype_of_identical_tokens_attends_exactly_as_the_tokens():
    model = tiny_llama()
    torch.manual_seed(0)
    m, dim, position = 6, 16, 37
    key, value = torch.randn(dim), torch.randn(dim)
    keys = key.expand(1, m, dim).clone()
    values = value.expand(1, m, dim).clone()
    at = torch.full((1, m), position)
    rope = RopeTable(model, 64, keys)
    nodes = summarize(rope, keys, unrotate(rope, keys, at), values, at, torch.rand(1, m), torch.ones(m, dtype=torch.bool), m, 0.1)
    assert torch.allclose(nodes.keys[0, 0], key, atol=1e-5) and torch.allclose(nodes.values[0, 0], value, atol=1e-6)
    assert nodes.log_weights[0, 0].item() == pytest.approx(math.log(m), abs=1e-6)
    assert nodes.positions[0, 0].item() == position
    others_k, others_v, query = torch.randn(5, dim), torch.randn(5, dim), torch.randn(dim)
    tokens = attend(query, torch.cat([others_k, keys[0]]), torch.cat([others_v, values[0]]), torch.zeros(5 + m))
    merged = attend(query, torch.cat([others_k, nodes.keys[0]]), torch.cat([others_v, nodes.values[0]]),
                    torch.cat([torch.zeros(5), nodes.log_weights[0]]))
    assert torch.allclose(tokens, merged, atol=1e-5)


def test_prototype_weight_counts_scattered_keys_less():
    model = tiny_llama()
    torch.manual_seed(1)
    m, dim = 8, 16
    positions = torch.arange(10, 10 + m)[None]
    # The same un-rotated key at m positions: coherence 1, so m_eff = m; its mean position is 13.5 -> 14.
    same = torch.randn(dim).expand(1, m, dim)
    cos, sin = adapter.rope_at(model, positions, same)
    rotated = adapter.apply_rope(same, cos, sin)
    rope = RopeTable(model, 64, rotated)
    aligned = summarize(rope, rotated, unrotate(rope, rotated, positions), torch.randn(1, m, dim), positions,
                        torch.rand(1, m), torch.ones(m, dtype=torch.bool), m, 0.1)
    assert aligned.log_weights[0, 0].item() == pytest.approx(math.log(m), abs=1e-4)
    cos14, sin14 = adapter.rope_at(model, torch.tensor([14]), same)
    assert torch.allclose(aligned.keys[0, 0], adapter.apply_rope(same[0, :1], cos14, sin14)[0], atol=1e-5)
    random_keys = torch.randn(1, m, dim)
    scattered = summarize(rope, random_keys, unrotate(rope, random_keys, positions), torch.randn(1, m, dim),
                          positions, torch.rand(1, m), torch.ones(m, dtype=torch.bool), m, 0.1)
    assert 0 <= scattered.log_weights[0, 0].item() < math.log(m) - 0.5


def heap_order(levels):
    """The straightforward greedy: one max-heap of available actions, children pushed when a parent pops."""
    offsets = np.cumsum([0] + [level.numel() for level in levels])
    units = levels[0].shape[0]

    def flat(a, u, i):
        return int(offsets[a] + u * levels[a].shape[1] + i)

    def push(heap, a, u, i):
        heapq.heappush(heap, (-float(levels[a][u, i]), flat(a, u, i), a, u, i))

    heap = []
    for u in range(units):
        push(heap, 0, u, 0)
    order = []
    while heap:
        _, index, a, u, i = heapq.heappop(heap)
        order.append(index)
        if a + 1 < len(levels):
            for child in ([0] if a == 0 else [2 * i, 2 * i + 1]):
                push(heap, a + 1, u, child)
    return order


@settings(max_examples=60, deadline=None)
@given(units=st.integers(1, 6), depth=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_greedy_order_is_the_heap_order(units, depth, seed):
    gen = torch.Generator().manual_seed(seed)
    levels = [torch.randn(units, 1, generator=gen)] + [torch.randn(units, 2 ** max(a - 1, 0), generator=gen)
                                                        for a in range(1, depth + 1)]
    assert greedy_order(levels).tolist() == heap_order(levels)


def test_greedy_order_with_wide_gain_ranges_matches_the_heap():
    gen = torch.Generator().manual_seed(3)
    levels = [torch.randn(40, 1, generator=gen).exp() * 10] + [
        (torch.randn(40, 2 ** max(a - 1, 0), generator=gen) * 3).exp() for a in range(1, 7)
    ]
    assert greedy_order(levels).tolist() == heap_order(levels)


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    length=st.integers(1, 260),
    budget=st.integers(1, 300),
    slot=st.sampled_from([1, 2, 8, 64]),
    singletons=st.sampled_from([0.0, 0.2, 1.0]),
)
def test_totals_are_exact_for_any_budget(num_layers, kv_heads, length, budget, slot, singletons):
    state = fake_state(num_layers, length, kv_heads=kv_heads, query_heads=2 * kv_heads)
    method = make_method(f"gracekv:slots=fixed:slot={slot}:singletons={singletons}")
    check_exact_totals(state, method, budget)


@settings(max_examples=25, deadline=None)
@given(
    num_layers=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    length=st.integers(1, 200),
    budget=st.integers(1, 220),
    singletons=st.sampled_from([0.0, 0.2, 1.0]),
    depth=st.sampled_from([1, 16]),
)
def test_published_totals_are_exact_for_any_budget(num_layers, kv_heads, length, budget, singletons, depth):
    state = fake_state(num_layers, length, kv_heads=kv_heads, query_heads=2 * kv_heads)
    method = make_method(f"gracekv:singletons={singletons}:depth={depth}:min_slot=4:slot=8:max_slot=16")
    check_exact_totals(state, method, budget)


def check_exact_totals(state, method, budget):
    num_layers, kv_heads, length = state.num_layers, state.num_kv_heads, state.length
    counts = method.budgets(state, budget)
    built = method.compress(state, budget)
    kept = torch.stack([layer.counts for layer in built])
    assert kept.tolist() == counts.tolist()
    assert int(kept.sum()) == num_layers * kv_heads * min(budget, length)
    for layer in built:
        for h in range(kv_heads):
            count = int(layer.counts[h])
            positions = layer.positions[h, :count]
            assert bool((positions >= 0).all()) and bool((positions < length).all())
            assert bool((layer.positions[h, count:] == -1).all())
            if layer.log_weights is not None:
                weights = layer.log_weights[h, :count]
                assert bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())


def test_budget_at_least_n_reproduces_the_full_cache(tiny_model):
    state = prefill(tiny_model, prompt(150), capture_window=64)
    full_tokens = greedy_decode(tiny_model, state, None, 8)[0]
    full = teacher_forced_logprobs(tiny_model, state, None, full_tokens)
    method = make_method("gracekv")
    for budget in (150, 400):
        variant = teacher_forced_logprobs(tiny_model, state, [method.compress(state, budget)], full_tokens)
        assert torch.equal(variant, full)
    # One entry short of the prompt: a merge happens and the logits move, while the totals stay exact.
    short = method.compress(state, 149)
    assert sum(layer.total() for layer in short) == state.num_layers * state.num_kv_heads * 149
    assert any(layer.log_weights is not None and bool((layer.log_weights > 0).any()) for layer in short)


def test_prototypes_span_a_slot_and_spend_the_budget_across_heads(tiny_model):
    state = prefill(tiny_model, prompt(400), capture_window=64)
    method = make_method("gracekv")
    counts = method.budgets(state, 64)
    assert counts.sum() == state.num_layers * state.num_kv_heads * 64
    assert len(np.unique(counts)) > 1  # heads and layers win different shares of the one budget
    built = method.compress(state, 64)
    merged = sum(int((layer.log_weights > 0).sum()) for layer in built)
    assert merged > 0
    # The published form uses both split kinds on a real prefill, and cuts slots of several lengths.
    notes = method.build_notes(state, 64)
    assert notes["splits"]["bisect"] > 0 and notes["splits"]["pull"] > 0
    assert 16 <= notes["slot_lengths"][0] < notes["slot_lengths"][2] <= 128
    fixed = make_method("gracekv:slots=fixed")
    assert fixed.budgets(state, 64).sum() == counts.sum()
    assert fixed.build_notes(state, 64)["splits"]["pull"] == 0


def test_deterministic():
    model = tiny_llama(seed=2)
    ids = prompt(300, seed=4)
    runs = []
    for _ in range(2):
        state = prefill(model, ids, capture_window=64)
        runs.append(make_method("gracekv").compress(state, 48))
    for a, b in zip(*runs):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.positions, b.positions) and torch.equal(a.log_weights, b.log_weights)


def test_bad_options_and_swapped_components_are_one_line_errors():
    state = fake_state(1, 200)
    for spec, message in (
        ("gracekv:slots=fixed:slot=48", "power of two"),
        ("gracekv:slots=wavy", "curvature or fixed"),
        ("gracekv:min_slot=80", "min_slot <= slot"),
        ("gracekv:slots=fixed:ends=free", "needs slots=curvature"),
        ("gracekv:widths=2/0.5", "positive integers"),
        ("gracekv:singletons=2", "share"),
        ("gracekv:sinks=-1", "non-negative"),
    ):
        with pytest.raises(UserError, match=message):
            make_method(spec)
    # GraceKV is not an allocator x scorer: swapping a component in or out is refused when the spec is read.
    with pytest.raises(UserError, match="takes no scorer="):
        make_method("gracekv:scorer=snapkv")
    with pytest.raises(UserError, match="unknown scorer 'gracekv'"):
        make_method("snapkv:scorer=gracekv")
    with pytest.raises(UserError, match="unknown allocator 'gracekv'"):
        make_method("snapkv:allocator=gracekv")
    assert make_method("gracekv:window=16").budgets(state, 40).sum() == 2 * 40  # one layer, two KV heads
    assert make_method("gracekv:slot=48").budgets(state, 40).sum() == 2 * 40  # any target in min_slot..max_slot


def test_free_ends_keep_sinks_and_window_beside_the_budget():
    state = fake_state(2, 300)
    method = make_method("gracekv:ends=free")
    assert method.budgets(state, 40).sum() == 2 * 2 * (40 + 32 + 4)
    assert make_method("gracekv:ends=free").budgets(state, 264).sum() == 2 * 2 * 300  # all of it: the full cache


def brute_force(scores, lo, hi, target, shape):
    """The best objective over every cut of len(scores) tokens into slots of lo..hi tokens."""
    best = -math.inf

    def walk(start, starts):
        nonlocal best
        if start == len(scores):
            best = max(best, segment_value(scores, starts, target, shape))
            return
        for length in range(lo, hi + 1):
            if start + length <= len(scores):
                walk(start + length, [*starts, start])

    walk(0, [])
    return best


@settings(max_examples=80, deadline=None)
@given(m=st.integers(3, 16), lo=st.integers(1, 3), extra=st.integers(0, 3), shape=st.sampled_from([0.0, 0.7, 3.0]),
       seed=st.integers(0, 10_000))
def test_slot_dp_matches_brute_force(m, lo, extra, shape, seed):
    hi = 2 * lo - 1 + extra
    target = (lo + hi) // 2
    scores = np.random.default_rng(seed).normal(size=m)
    starts = segment(scores, lo, hi, target, shape)
    if m <= lo:
        assert starts == [0]
        return
    ends = [*starts[1:], m]
    assert starts[0] == 0 and all(lo <= e - s <= hi for s, e in zip(starts, ends))
    assert segment_value(scores, starts, target, shape) == pytest.approx(brute_force(scores, lo, hi, target, shape), abs=1e-9)


def test_curvature_peaks_where_the_trajectory_turns():
    # Straight along x for 12 steps, then straight along y: a right-angle turn at token 12.
    steps = torch.cat([torch.tensor([[1.0, 0.0]]).expand(12, -1), torch.tensor([[0.0, 1.0]]).expand(12, -1)])
    trajectory = torch.cat([torch.zeros(1, 2), steps.cumsum(0)])
    for width in (2, 4):
        kappa = curvature(trajectory, width)
        assert int(kappa.argmax()) == 12 and kappa[12] > 0.5
        assert torch.allclose(kappa[width : 12 - width + 1], torch.zeros(13 - 2 * width), atol=1e-6)
        assert bool((kappa[:width] == 0).all())  # no window there
    z = robust_z(torch.tensor([0.0, 1.0, 2.0, 3.0, 100.0]))
    assert z[2] == 0 and z[4] > 10


def test_distortion_matches_a_direct_computation():
    """D through the slot's Gram matrix equals replacing each node's tokens by its prototype, query by query."""
    model = tiny_llama()
    gen = torch.Generator().manual_seed(5)
    heads, total, dim, rows, size = 2, 16, 16, 6, 4
    keys, values = torch.randn(heads, total, dim, generator=gen), torch.randn(heads, total, dim, generator=gen)
    positions = torch.arange(3, 3 + total).expand(heads, -1)
    has = torch.ones(total, dtype=torch.bool)
    has[[5, 13]] = False
    queries = torch.randn(heads, rows, dim, generator=gen)
    rope = RopeTable(model, 64, keys)
    nodes = summarize(rope, keys, unrotate(rope, keys, positions), values, positions,
                      torch.rand(heads, total, generator=gen), has, size, 0.1)
    logits = (queries @ keys.transpose(-1, -2) * 0.25).masked_fill(~has, float("-inf"))
    shift = logits.amax(-1, keepdim=True)
    ours = distortion(nodes, queries, shift.transpose(1, 2), 0.25, torch.exp(logits - shift).transpose(1, 2),
                      values * has[:, None], size)
    for h in range(heads):
        for s in range(total // size):
            members = [j for j in range(s * size, (s + 1) * size) if has[j]]
            errors = []
            for q in range(rows):
                a = torch.exp(logits[h, q, members] - shift[h, q, 0])
                mass, total_value = a.sum(), a @ values[h, members]
                proto = torch.exp(queries[h, q] @ nodes.keys[h, s] * 0.25 - shift[h, q, 0] + nodes.log_weights[h, s])
                errors.append(0.5 * ((proto - mass).abs() / mass
                                     + (proto * nodes.values[h, s] - total_value).norm() / total_value.norm()))
            expected = torch.stack(errors).mean() if len(members) > 1 else torch.tensor(0.0)
            assert ours[h, s].item() == pytest.approx(expected.item(), rel=2e-3, abs=1e-5)


@pytest.mark.slow
def test_eval_runs_gracekv_and_records_its_prompt_dependent_counts(tiny_model_dir, tmp_path, run_cli):
    import json

    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah",
                           "--limit", "1", "--target-tokens", "300", "--methods", "full,gracekv",
                           "--budget", "48", "--out", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    (grace,) = [r for r in rows if r["method"] == "gracekv"]
    assert grace["kept_entries"] == 4 * 2 * 48
    counts = np.array(grace["head_budgets"])
    assert counts.shape == (4, 2) and counts.sum() == 4 * 2 * 48 and len(np.unique(counts)) > 1
    check_fidelity(rows)


def test_inspect_reports_the_split_kinds_gracekv_used(tiny_model_dir, tmp_path, run_cli):
    import json

    out = tmp_path / "inspect"
    code, printed, err = run_cli("inspect", "--model", str(tiny_model_dir), "--suite", "offline", "--task", "niah",
                                 "--index", "0", "--method", "gracekv", "--budget", "48", "--target-tokens", "400",
                                 "--out", str(out))
    assert code == 0, err
    kept = np.load(out / "kept.npz")
    build = json.loads(str(kept["meta"]))["build"]
    assert build["splits"]["bisect"] > 0 and build["splits"]["pull"] > 0
    assert int(kept["counts"].sum()) == 4 * 2 * 48


def test_pricing_what_the_greedy_can_reach_and_sharing_trees_across_budgets_keep_every_entry(monkeypatch):
    """Only the splits that could be among a budget's pops are priced, and budgets share the trees of the slots
    whose floor tokens agree: each budget's entries equal those of pricing every node of a fresh state."""
    from ripplekv.methods.gracekv import published as gracekv_global

    spec, budgets = "gracekv:min_slot=8:slot=16:max_slot=32", (20, 60, 150, 390)
    state = fake_state(2, 400, kv_heads=2, query_heads=4)
    shared = {budget: make_method(spec).compress(state, budget) for budget in budgets}
    monkeypatch.setattr(gracekv_global, "PRICE_ALL", True)
    for budget in budgets:
        state.forget()
        for lazy, eager in zip(shared[budget], make_method(spec).compress(state, budget)):
            assert torch.equal(lazy.positions, eager.positions) and torch.equal(lazy.keys, eager.keys)
            assert torch.equal(lazy.values, eager.values)
            assert (lazy.log_weights is None) == (eager.log_weights is None)
            assert lazy.log_weights is None or torch.equal(lazy.log_weights, eager.log_weights)
    trees = next(value for key, value in state.memos.items() if key[0] is gracekv_global.shared_trees)
    assert len(trees.count) > 0
