"""Key channels (ThinK): the channels chosen, recomputed by hand; the bytes, counted from the built tensors; and the
matched-bytes rule that makes `snapkv:think=0.5` a rival of `snapkv` and `snapkv:quant=kivi:bits=4` at one budget."""

from __future__ import annotations

import math

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.quantize import QuantSpec, head_bytes
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.quantized import budget_bytes, kept_bytes, stored_as
from tests.conftest import tiny_llama

N = 160
SMALL = ":group=8:residual=16"


@pytest.fixture(scope="module", params=[(4, 4, 64), (4, 2, 64), (8, 2, 128)], ids=["mha-d16", "gqa2-d16", "gqa4-d16"])
def state(request):
    heads, kv_heads, hidden = request.param
    model = tiny_llama(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return prefill_for(model, torch.arange(N) % 97 + 3, Requirements(capture_window=32))


def stored_channels(layer, head: int) -> list[int]:
    """The channels of a head's keys that hold anything (the pruned ones are zero in every real entry)."""
    count = int(layer.counts[head])
    return torch.nonzero(layer.keys[head, :count].abs().sum(0)).flatten().tolist()


def hand_bytes(layers, element: int, spec: QuantSpec | None) -> int:
    """Bytes of the built entries from their tensors: per head, the stored key channels (counted in the keys)
    and every value channel, a full-precision tail of `residual` entries, packed integers and two numbers per
    group for the rest, and a channel mask of d bits where a head stores fewer than d key channels."""
    total = 0
    for layer in layers:
        d = layer.keys.shape[-1]
        for head, count in enumerate(layer.counts.tolist()):
            kept = len(stored_channels(layer, head))
            total += math.ceil(d / 8) if kept < d else 0
            tail = count if spec is None or spec.is_full_precision else min(count, spec.residual)
            rest = count - tail
            total += tail * (kept + d) * element
            if rest:
                key_groups = kept * -(-rest // spec.group)
                value_groups = rest * -(-d // spec.group)
                total += math.ceil(rest * kept * spec.key_bits / 8) + key_groups * 2 * element
                total += math.ceil(rest * d * spec.value_bits / 8) + value_groups * 2 * element
    return total


def think_pruned(state, layer: int, kept_positions: list[list[int]], ratio: float, window: int) -> list[set[int]]:
    """ThinK's pruned channels, by its formula written out per head: the mean over the last `window` queries of
    q_c^2 (over the query heads sharing the KV head) times the mean over the kept keys of k_c^2; the
    int(d x ratio) lowest."""
    keys = state.keys[layer].float()
    queries = state.signal("window_queries")[layer][:, -window:].float()
    group = queries.shape[0] // keys.shape[0]
    pruned = []
    for head, positions in enumerate(kept_positions):
        query_energy = torch.stack([(queries[head * group + g] ** 2).mean(0) for g in range(group)]).mean(0)
        key_energy = (keys[head, positions] ** 2).mean(0)
        score = (query_energy * key_energy).tolist()
        lowest = sorted(range(len(score)), key=lambda c: score[c])[: int(len(score) * ratio)]
        pruned.append(set(lowest))
    return pruned


def test_head_bytes_count_the_stored_key_channels_and_their_mask():
    d, element = 16, 2
    assert head_bytes(10, d, element, QuantSpec(bits=16, residual=0, key_channels=8)) == 10 * (8 + 16) * 2 + 2
    assert head_bytes(0, d, element, QuantSpec(bits=16, residual=0, key_channels=8)) == 0
    assert head_bytes(10, d, element, QuantSpec(bits=16, residual=0, key_channels=16)) == head_bytes(10, d, element, None)
    spec = QuantSpec(bits=4, group=8, residual=4, key_channels=4)
    keys = math.ceil(20 * 4 * 4 / 8) + 4 * math.ceil(20 / 8) * 2 * element
    values = math.ceil(20 * 16 * 4 / 8) + 20 * math.ceil(16 / 8) * 2 * element
    assert head_bytes(24, d, element, spec) == keys + values + 4 * (4 + 16) * element + 2
    assert QuantSpec(bits=4).describe() == {"key_axis": "channel", "bits": 4, "group": 32, "residual": 128}
    assert QuantSpec(bits=4).with_key_channels(8).describe()["key_channels"] == 8
    with pytest.raises(UserError, match="key_channels"):
        QuantSpec(key_channels=0)


@pytest.mark.parametrize("spec", ["snapkv:think=0.5", "snapkv:split=adakv:think=0.25:think_window=8",
                                  "pyramidkv:think=0.5"])
def test_the_channels_kept_are_thinks_over_the_entries_the_method_keeps(state, spec):
    method = make_method(spec)
    budget = 40
    chosen = method.entry_budget(state, budget)
    inner_mask = method.inner.select(state, chosen)
    built = method.compress(state, budget)
    for layer, entries in enumerate(built):
        positions = [torch.nonzero(inner_mask[layer, head]).flatten().tolist() for head in range(entries.num_heads)]
        expected = think_pruned(state, layer, positions, method.channels.ratio, method.channels.window)
        d = entries.keys.shape[-1]
        for head, count in enumerate(entries.counts.tolist()):
            assert sorted(entries.positions[head, :count].tolist()) == positions[head]
            kept = stored_channels(entries, head)
            assert set(range(d)) - set(kept) == expected[head], (spec, layer, head)
            source = state.keys[layer][head, entries.positions[head, :count]]
            assert torch.equal(entries.keys[head, :count][:, kept], source[:, kept])  # stored as they were
            assert torch.equal(entries.values[head, :count], state.values[layer][head, entries.positions[head, :count]])


@pytest.mark.parametrize("budget", [24, 80])
@pytest.mark.parametrize("spec", ["snapkv:think=0.5", f"snapkv:think=0.5:quant=kivi:bits=4{SMALL}",
                                  f"snapkv:split=adakv:think=0.25:quant=kivi:bits=2{SMALL}", "streamingllm:think=0.75"])
def test_pruned_keys_buy_more_entries_within_the_budgets_bytes(state, spec, budget):
    """At budget B a key-channel variant keeps the most entries whose bytes (counted from the tensors) fit in B's:
    more than eviction alone, within the stated rounding of the budget."""
    method = make_method(spec)
    target = budget_bytes(state, budget)
    counts = method.budgets(state, budget)
    layers = method.compress(state, budget)
    specs = stored_as(method, state, budget)
    element = state.keys[0].element_size()
    quantizer = None if method.quantizer.is_full_precision else method.quantizer
    recorded = kept_bytes(state, counts, specs)
    assert recorded == hand_bytes(layers, element, quantizer or specs[0]), spec
    assert recorded <= target
    eviction = make_method(spec.split(":")[0]).budgets(state, budget)
    assert counts.sum() > eviction.sum(), spec  # the bytes freed bought entries
    chosen = method.entry_budget(state, budget)
    if chosen < N:
        full_entry = 2 * state.keys[0].shape[-1] * element
        assert target - state.num_layers * state.num_kv_heads * 2 * full_entry < recorded
        assert kept_bytes(state, method.inner.budgets(state, chosen + 1), specs) > target


def test_quantized_pruned_keys_store_their_kept_channels_at_the_bits_and_the_rest_as_zero(state):
    method = make_method(f"snapkv:think=0.5:quant=kivi:bits=2{SMALL}")
    layers = method.compress(state, 48)
    d = state.keys[0].shape[-1]
    for entries in layers:
        for head, count in enumerate(entries.counts.tolist()):
            kept = stored_channels(entries, head)
            assert len(kept) == d // 2
            order = entries.positions[head, :count].argsort()
            quantized = entries.keys[head, :count][order][: count - 16]  # the last 16 are the full-precision residual
            for channel in kept:
                for start in range(0, len(quantized), 8):  # KIVI's per-channel groups of 8 entries: 4 levels at most
                    assert len(torch.unique(quantized[start:start + 8, channel])) <= 4


def test_think_alone_keeps_every_entry_where_it_fits_and_is_refused_where_not(state):
    method = make_method("think")
    keys_before = [k.clone() for k in state.keys]
    d, element = state.keys[0].shape[-1], state.keys[0].element_size()
    per_head = N * (d // 2 + d) * element + math.ceil(d / 8)
    fits = -(-per_head // (2 * d * element))  # the fewest entries per head whose full-precision bytes hold it
    assert method.infeasible(state, fits) is None and method.infeasible(state, fits - 1) is not None
    with pytest.raises(UserError, match=f"{d // 2} of {d} key channels"):
        method.budgets(state, fits - 1)
    counts = method.budgets(state, fits)
    assert int(counts.min()) == N
    method.compress(state, fits)
    assert all(torch.equal(a, b) for a, b in zip(keys_before, state.keys))  # the prefill's keys untouched


def test_specs_labels_and_descriptions():
    assert make_method("snapkv:think=0.50").label == "snapkv:think=0.5"
    assert make_method("snapkv:think_window=16:think=.5").label == "snapkv:think=0.5:think_window=16"
    both = make_method("snapkv:think=0.5:quant=kivi:bits=4")
    assert both.label == "snapkv:quant=kivi:bits=4:think=0.5"
    assert both.describe()["key_channels"] == {"ratio": 0.5, "window": 32} and both.describe()["quantizer"]["bits"] == 4
    alone = make_method("snapkv:think=0.5").describe()
    assert "quantizer" not in alone and alone["scorer"]["name"] == "snapkv"
    assert make_method("think").label == "think" and make_method("think:ratio=0.25").label == "think:ratio=0.25"
    assert make_method("kivi:think=0.5").label == "kivi:think=0.5"
    assert make_method("snapkv:think=0.5:think_window=48").requirements().capture_window == 48
    for bad, message in (("think:quant=kivi", "kivi:think=0.5"), ("snapkv:think=0", "strictly between 0 and 1"),
                         ("snapkv:think=nan", "strictly between"), ("snapkv:think_window=8", "needs think=RATIO"),
                         ("snapkv:think=0.5:think_window=0", "positive integer"), ("think:window=x", "an integer"),
                         ("think:bits=4", "needs a quantizer"), ("think:kernel=3", "think takes only ratio")):
        with pytest.raises(UserError, match=message):
            make_method(bad)


def test_the_memory_table_shows_key_channel_rows_beside_the_others():
    import pandas as pd

    from ripplekv.analysis.memory_axis import bits_of, memory_table

    assert bits_of({"key_channels": {"ratio": 0.5, "window": 32}}) == "16, keys x0.5 ch"
    assert bits_of({"quantizer": {"bits": 4}, "key_channels": {"ratio": 0.25, "window": 32}}) == "4, keys x0.75 ch"
    lines = [{"task": "niah", "id": f"s{i}", "method": method, "budget": 64, "kept_entries": entries, "kv_bytes": 100,
              "kv_budget_bytes": 100, "kl": 0.1} for method, entries in (("snapkv", 10), ("snapkv:think=0.5", 13))
             for i in range(3)]
    board = pd.DataFrame({"method": ["snapkv", "snapkv:think=0.5"], "budget": [64, 64], "kl": [0.2, 0.1]})
    specs = {"snapkv": {}, "snapkv:think=0.5": {"key_channels": {"ratio": 0.5, "window": 32}}}
    table = memory_table(pd.DataFrame(lines), board, specs)
    assert table is not None and list(table["method"]) == ["snapkv:think=0.5", "snapkv"]
    assert list(table["entries"]) == [13, 10]
