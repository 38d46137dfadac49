"""Divergence decoding gives plain greedy decoding's tokens and measure_fidelity's numbers, decoding less."""

import pytest
import torch

from ripplekv.engine.decode import full_reference, greedy_decode, measure_fidelity
from ripplekv.engine.divergence import decode_by_divergence
from ripplekv.engine.prefill import prefill
from tests.conftest import every_method


def prompt(length, vocab=101, seed=1):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def shared(a, b):
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def variants_of(state, folder, budgets=(8, 24, 400), names=("snapkv", "streamingllm", "pyramidkv", "h2o")):
    """A few methods at small budgets (they diverge early) and one above the prompt (never diverges)."""
    methods = every_method(state.num_layers, folder)
    return [methods[name].compress(state, b) for name in names for b in budgets]


@pytest.mark.parametrize("protocol", ["with-question", "context-only"])
def test_divergence_decoding_equals_plain_greedy(tiny_model, tmp_path, protocol):
    ids = prompt(160)
    context, question = (ids[:140], ids[140:].tolist()) if protocol == "context-only" else (ids, None)
    state = prefill(tiny_model, context, capture_window=32, accumulate=True)
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
    state = prefill(tiny_model, ids, capture_window=32, accumulate=True)
    built = variants_of(state, tmp_path, budgets=(8, 16), names=("snapkv", "streamingllm"))
    reference = full_reference(tiny_model, state, 10)
    whole = decode_by_divergence(tiny_model, state, built, reference, 10)
    split = decode_by_divergence(tiny_model, state, built, reference, 10, memory_bytes=1)
    assert whole.decoded > 1 and whole.batches == 1
    assert split.batches == split.decoded  # one variant per batch
    assert split.tokens == whole.tokens == greedy_decode(tiny_model, state, built, 10)
