"""Exact totals: every method keeps L*H_kv*B entries (or everything when n <= B), whatever n, B, L."""

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ripplekv.engine.prefill import PrefillState
from ripplekv.engine.recorders import RECORDERS, WINDOW_QUERIES, SampleContext, Setup
from ripplekv.errors import UserError
from ripplekv.methods import make_method, method_names
from ripplekv.methods.compactor import NonCausalAttention
from ripplekv.methods.core.budgets import integer_budgets
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from ripplekv.methods.signals.query_statistics import QUERY_STATISTICS, query_statistics
from tests.conftest import every_method, satisfy, tiny_llama


def rope_model(query_heads: int, kv_heads: int, dim: int, num_layers: int = 1):
    """A tiny Llama whose RoPE and shapes match the fake K/V (GraceKV un-rotates keys with the model's RoPE;
    CriticalKV reads each layer's output projection, KVzip and the oracle feed tokens through it).

    Built once per shape: a hypothesis test asks for hundreds of states. The global torch RNG is left as
    building it left it, so what is drawn after (the fake queries' RoPE) is what it always was."""
    model, rng_after = _rope_model(query_heads, kv_heads, dim, num_layers)
    torch.set_rng_state(rng_after)
    return model


@functools.cache
def _rope_model(query_heads: int, kv_heads: int, dim: int, num_layers: int):
    model = tiny_llama(num_hidden_layers=num_layers, hidden_size=query_heads * dim, num_attention_heads=query_heads,
                       num_key_value_heads=kv_heads, head_dim=dim, intermediate_size=16)
    return model, torch.get_rng_state()


def fake_state(num_layers: int, length: int, kv_heads: int = 2, query_heads: int = 4, dim: int = 8, seed: int = 0):
    """A prefill state with random K/V, window queries and accumulated attention, enough for every method."""
    gen = torch.Generator().manual_seed(seed)
    window = min(64, length)
    accumulated = [torch.rand(kv_heads, length, generator=gen) for _ in range(num_layers)]
    keys = [torch.randn(kv_heads, length, dim, generator=gen) for _ in range(num_layers)]
    values = [torch.randn(kv_heads, length, dim, generator=gen) for _ in range(num_layers)]
    queries = [torch.randn(query_heads, window, dim, generator=gen) for _ in range(num_layers)]
    model = rope_model(query_heads, kv_heads, dim, num_layers)
    statistics = [query_statistics(torch.randn(query_heads, length, dim, generator=gen), *rope_at_length(length, dim))
                  for _ in range(num_layers)]
    state = PrefillState(
        input_ids=torch.zeros(length, dtype=torch.long), keys=keys, values=values, last_logits=torch.zeros(10),
        scaling=dim**-0.5, model=model,
        signals={COLUMN_SUMS: accumulated, WINDOW_QUERIES: queries, QUERY_STATISTICS: statistics},
    )
    return with_noncausal_attention(state, query_heads, seed)


def with_noncausal_attention(state, query_heads: int, seed: int):
    """The state with every chunking registered so far of Compactor's non-causal attention, over random queries."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, recorder in RECORDERS.items():
        if issubclass(recorder, NonCausalAttention):
            made = recorder(Setup(state.model, state.length, 0, SampleContext()))
            for layer, keys in enumerate(state.keys):
                queries = torch.randn(query_heads, *keys.shape[1:], generator=gen)
                made.layer(layer, queries[None], keys[None], state.values[layer][None], None, state.scaling)
            state.signals[name] = made.result(state.num_layers)
    return state


def rope_at_length(length: int, dim: int):
    """Some (cos, sin) for the fake queries (their statistics need only be well formed)."""
    angles = torch.arange(length)[:, None] * torch.rand(dim // 2)[None].repeat(1, 2)
    return angles.cos(), angles.sin()


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 50.0, allow_nan=False), min_size=1, max_size=40),
    budget=st.integers(1, 600),
    length=st.integers(1, 3000),
    floor=st.integers(1, 64),
)
def test_integer_budgets_exact_and_bounded(weights, budget, length, floor):
    counts = integer_budgets(weights, budget, length, floor)
    num_layers = len(weights)
    if length <= budget:
        assert counts == [length] * num_layers
    else:
        assert sum(counts) == num_layers * budget
        assert all(min(floor, budget) <= c <= length for c in counts)


def test_integer_budgets_follow_proportions_when_unclamped():
    assert integer_budgets([1, 2, 3, 2], 100, 10_000) == [50, 100, 150, 100]
    # 3 layers, 100 each: 0.5/1.5/1.0 -> 50/150/100 exactly; odd remainders go to the largest fractions.
    assert sum(integer_budgets([1.0, 1.0, 1.0], 7, 100)) == 21


def test_clamping_redistributes_to_other_layers():
    # Layer 0 wants 4x the average but n caps it; the excess goes to the others in proportion.
    counts = integer_budgets([4.0, 1.0, 1.0, 1.0], 100, 150)
    assert counts[0] == 150 and sum(counts) == 400 and counts[1:] == [84, 83, 83]


def test_bad_budget_is_a_user_error():
    for bad in (0, -3, 2.5, "8", True):
        with pytest.raises(UserError, match="positive integer"):
            integer_budgets([1.0], bad, 100)


@pytest.mark.parametrize("name", method_names())
@settings(max_examples=4, deadline=None)
@given(
    num_layers=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    length=st.integers(1, 300),
    budget=st.integers(1, 400),
)
@example(num_layers=1, kv_heads=1, length=2, budget=1)  # lava: max_pool1d on an empty prefix (a 2-token prompt)
def test_every_method_keeps_exactly_the_matched_total(name, num_layers, kv_heads, length, budget):
    """For every registered method (layer- and head-level allocators alike): L*H*min(B, n) entries in all,
    entries built per head equal to the allocated [L, H] matrix, and no head over n."""
    state = satisfy(fake_state(num_layers, length, kv_heads=kv_heads, query_heads=2 * kv_heads))
    with tempfile.TemporaryDirectory() as folder:  # a method may read its inputs (a curve) when it allocates
        method = every_method(num_layers, Path(folder), only=name, kv_heads=kv_heads, head_dim=8)[name]  # fake_state's
        if getattr(method, "quantizer", None) is not None:  # budget B is bytes here (tests/test_memory_axis.py)
            return check_bytes(method, state, budget)
        counts = method.budgets(state, budget)
        built = method.compress(state, budget)
    kept = torch.stack([layer.counts for layer in built])
    assert kept.tolist() == counts.tolist()
    expected = length if method.is_full else min(budget, length)
    assert int(kept.sum()) == num_layers * kv_heads * expected
    assert int(kept.max()) <= length
    if not method.prompt_dependent:
        assert [row[0] for row in counts.tolist()] == method.layer_budgets(num_layers, budget, length)


def check_bytes(method, state, budget: int) -> None:
    """A quantized method: refused in one line where its bytes cannot fit, else never over the budget's bytes."""
    from ripplekv.methods.core.quantized import budget_bytes, kept_bytes, stored_as

    if method.infeasible(state, budget):
        with pytest.raises(UserError, match="over budget"):
            method.budgets(state, budget)
        return
    counts = method.budgets(state, budget)
    assert [layer.counts.tolist() for layer in method.compress(state, budget)] == counts.tolist()
    assert kept_bytes(state, counts, stored_as(method, state, budget)) <= budget_bytes(state, budget)


def test_pyramidkv_decreases_with_depth_and_matches_uniform_total():
    method = make_method("pyramidkv")
    counts = method.layer_budgets(30, 128, 3500)
    assert sum(counts) == 30 * 128 == sum(make_method("snapkv").layer_budgets(30, 128, 3500))
    assert all(a >= b for a, b in zip(counts, counts[1:])) and counts[0] > counts[-1]
    # PyramidKV's schedule: window + (2 - 1/beta) * (B - window) at the top, window + (B - window)/beta at the bottom.
    assert counts[0] == pytest.approx(32 + (2 - 1 / 20) * 96, abs=1)
    assert counts[-1] == pytest.approx(32 + 96 / 20, abs=1)
