"""Divergence decoding gives plain greedy decoding's tokens and measure_fidelity's numbers, decoding less."""

import pytest
import torch

from ripplekv.engine.decode import full_reference, greedy_decode, measure_fidelity
from ripplekv.engine.divergence import decode_by_divergence
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.engine.schedule import Decoding
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from tests.conftest import every_method


def prompt(length, vocab=101, seed=1):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def shared(a, b):
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def variants_of(state, folder, budgets=(8, 24, 400), names=("snapkv", "streamingllm", "pyramidkv", "h2o")):
    """A few methods at small budgets (they diverge early) and one above the prompt (never diverges)."""
    methods = every_method(state.num_layers, folder, kv_heads=state.num_kv_heads)
    return [methods[name].compress(state, b) for name in names for b in budgets]


@pytest.mark.parametrize("protocol", ["with-question", "context-only"])
def test_divergence_decoding_equals_plain_greedy(tiny_model, tmp_path, protocol):
    ids = prompt(160)
    context, question = (ids[:140], ids[140:].tolist()) if protocol == "context-only" else (ids, None)
    state = prefill(tiny_model, context, capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    built = variants_of(state, tmp_path)
    for steps, stops in ((10, ()), (10, None)):
        reference = full_reference(tiny_model, state, steps, (), prefix=question)
        if stops is None:  # a stop token the full answer produces mid-way: variants stop (or not) as alone
            stops = [reference.tokens[5]]
            reference = full_reference(tiny_model, state, steps, stops, prefix=question)
        plain = greedy_decode(tiny_model, state, built, steps, stops, prefix=question)
        result = decode_by_divergence(tiny_model, state, built, reference, steps, stops, prefix=question,
                                      fidelity_batch=5)
        assert result.tokens == plain
        assert result.fidelity == measure_fidelity(tiny_model, state, built, reference, 5, prefix=question)
        # Only variants that left the full answer before its end were decoded; the full-budget ones never.
        assert result.decoded == sum(1 for t in plain if t != reference.tokens and len(t) > shared(t, reference.tokens) + 1)
        assert result.decoded < len(built)


def test_a_small_memory_bound_splits_the_batch_without_changing_tokens(tmp_path):
    from tests.conftest import tiny_llama

    tiny_model = tiny_llama()
    ids = prompt(120, seed=3)
    state = prefill(tiny_model, ids, capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    built = variants_of(state, tmp_path, budgets=(8, 16), names=("snapkv", "streamingllm"))
    reference = full_reference(tiny_model, state, 10)
    whole = decode_by_divergence(tiny_model, state, built, reference, 10)
    split = decode_by_divergence(tiny_model, state, built, reference, 10, memory_bytes=1)
    assert whole.decoded > 1 and whole.batches == 1
    assert split.batches == split.decoded  # one variant per batch
    assert split.tokens == whole.tokens == greedy_decode(tiny_model, state, built, 10)


def test_groups_split_off_long_caches_when_padding_costs_more_than_a_forward():
    from ripplekv.engine.memory import plan_groups

    def decoding_groups(lengths, remaining, each, fixed, memory_bytes, most=None):
        return plan_groups(lengths, remaining, lambda k, padded: k * (sum(e * p for e, p in zip(each, padded)) + fixed),
                           memory_bytes, most)

    layers, short, long = 30, 64, 2000
    lengths = [[short] * layers] * 10 + [[long] * layers] * 2
    lengths = [lengths[i] for i in (3, 10, 0, 1, 2, 11, 4, 5, 6, 7, 8, 9)]  # given in any order
    remaining = [30] * len(lengths)
    groups = decoding_groups(lengths, remaining, [1] * layers, 0, memory_bytes=2**40)
    assert sorted(i for g in groups for i in g) == list(range(12))
    assert sorted(sorted(lengths[i][0] for i in g) for g in groups) == [[short] * 10, [long] * 2]
    # Equal lengths pad nothing: one forward a step for all of them.
    assert decoding_groups([[short] * layers] * 12, remaining, [1] * layers, 0, memory_bytes=2**40) == [list(range(12))]
    # A memory bound caps every group (k variants x padded entries x bytes per entry), one variant always fits.
    capped = decoding_groups([[short] * layers] * 12, remaining, [1] * layers, 0, memory_bytes=short * layers * 5)
    assert max(len(g) for g in capped) <= 5 and sum(len(g) for g in capped) == 12
    assert decoding_groups([[long] * layers] * 3, [30] * 3, [1] * layers, 0, memory_bytes=1) == [[0], [1], [2]]
    # ... and a count cap (--batch-size).
    most = decoding_groups([[short] * layers] * 12, remaining, [1] * layers, 0, 2**40, most=5)
    assert max(len(g) for g in most) <= 5 and sorted(i for g in most for i in g) == list(range(12))


def test_entry_bytes_is_what_one_more_kept_entry_adds_to_a_variant(tiny_model, tmp_path):
    from ripplekv.engine.cache import build_cache
    from ripplekv.engine.divergence import entry_bytes, variant_bytes

    state = prefill(tiny_model, prompt(80), capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    cache = build_cache(state, variants_of(state, tmp_path, budgets=(8, 24), names=("snapkv", "pyramidkv")))
    layers = len(cache.layers)
    for layer in range(layers):
        one = [int(i == layer) for i in range(layers)]
        assert entry_bytes(cache)[layer] == variant_bytes(cache, 5, one) - variant_bytes(cache, 5, [0] * layers) > 0


@pytest.mark.parametrize("decoding", ["divergence", "plain"])
def test_a_finished_group_is_gone_before_the_next_group_is_built(tmp_path, monkeypatch, decoding):
    """Nothing of a decoded group may outlive it: the memory bound plans each group beside the sample's own
    tensors only (a loop variable that kept a group's last layer held 0.25 GiB past a 2 GiB bound)."""
    import weakref

    from ripplekv.engine import divergence
    from ripplekv.engine.memory import LazyVariants
    from tests.conftest import tiny_llama

    model = tiny_llama()
    state = prefill(model, prompt(120, seed=3), capture_window=32)  # snapkv and streamingllm need no signal
    methods = every_method(state.num_layers, tmp_path, kv_heads=state.num_kv_heads)
    specs = [(name, budget) for name in ("snapkv", "streamingllm") for budget in (8, 16)]
    reference = full_reference(model, state, 10)
    held, alive_at_build = [], []  # weak references to every group's entries and cache layers
    real_build_lazily = divergence.build_lazily

    def build_lazily(*args):
        cache = real_build_lazily(*args)
        held.extend(weakref.ref(layer) for layer in cache.layers)
        return cache

    def build(index):  # a fresh build, as the engine's: nothing else keeps it
        alive_at_build.append(sum(ref() is not None for ref in held))
        name, budget = specs[index]
        entries = methods[name].compress(state, budget)
        held.extend(weakref.ref(layer) for layer in entries)
        return entries

    monkeypatch.setattr(divergence, "build_lazily", build_lazily)
    lengths = [[layer.capacity for layer in build(i)] for i in range(len(specs))]
    alive_at_build.clear()
    tokens, _ = divergence.decode_variants(model, state, LazyVariants(lengths, build), reference,
                                           Decoding(10, decoding=decoding), memory_bytes=1)
    assert alive_at_build == [0] * len(specs)  # groups of one: nothing earlier alive at any build
    assert tokens == greedy_decode(model, state, [methods[n].compress(state, b) for n, b in specs], 10)
