"""Budget B is memory: eviction, quantization and both spend the same bytes, counted independently here."""

from __future__ import annotations

import math

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.quantized import budget_bytes, kept_bytes, stored_as
from tests.conftest import tiny_llama

N = 160  # prompt tokens


def independent_bytes(layers, element: int, bits, group: int, residual: int, per_channel: bool) -> int:
    """Bytes of the built entries, from their tensors: per head, its real entries split into a full-precision
    tail and a quantized head; integers packed, two numbers (minimum, scale) per group; `bits` None (full
    precision) or (key bits, value bits) per layer, 16 meaning that tensor at full precision, no groups."""
    total = 0
    for number, layer in enumerate(layers):
        d = layer.keys.shape[-1]
        for count in layer.counts.tolist():
            if bits is None:
                total += count * d * element * 2
                continue
            tail = min(count, residual)
            quantized = count - tail
            total += tail * d * element * 2
            value_groups = quantized * -(-d // group)
            key_groups = d * -(-quantized // group) if per_channel else value_groups
            for width, groups in zip(bits[number], (key_groups, value_groups)):
                if width == 16:
                    total += quantized * d * element
                else:
                    total += math.ceil(quantized * d * width / 8) + groups * 2 * element
    return total


def levels_within(layer, bits: int, group: int, residual: int) -> bool:
    """Every quantized value group (per token, `group` channels) holds at most 2^bits distinct numbers."""
    for head, count in enumerate(layer.counts.tolist()):
        order = layer.positions[head, :count].argsort()
        values = layer.values[head, :count][order][: max(count - residual, 0)]
        for start in range(0, values.shape[-1], group):
            for row in values[:, start:start + group]:
                if len(torch.unique(row)) > 2**bits:
                    return False
    return True


@pytest.fixture(scope="module", params=[(4, 4, 64), (4, 2, 64), (8, 2, 128), (4, 1, 32)],
                ids=["mha-d16", "gqa2-d16", "gqa4-d16", "mqa-d8"])
def state(request):
    heads, kv_heads, hidden = request.param
    model = tiny_llama(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return prefill_for(model, torch.arange(N) % 97 + 3, Requirements(capture_window=32))


SENSITIVITY = (1e-4, 5e-3, 2e-5, 1e-3)  # a profile of the tiny models' 4 layers: layer 1 the most sensitive


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    """An allocation file as `ripplekv allocate` writes it (layer,sensitivity,multiplier)."""
    path = tmp_path_factory.mktemp("profile") / "allocation.csv"
    multipliers = (0.8, 1.3, 0.7, 1.2)
    path.write_text("layer,sensitivity,multiplier\n" + "".join(f"{layer},{s},{m}\n" for layer, (s, m)
                                                               in enumerate(zip(SENSITIVITY, multipliers))))
    return str(path)


SMALL = ":group=8:residual=16"
QUANTIZED = [f"snapkv:quant=kivi:bits=4{SMALL}", f"snapkv:quant=kivi:bits=2{SMALL}", f"pyramidkv:quant=kivi:bits=8{SMALL}",
             f"snapkv:split=adakv:quant=kivi:bits=2{SMALL}", f"streamingllm:quant=token:bits=4{SMALL}",
             "snapkv:quant=kivi:bits=4", f"snapkv:quant=kivi:kbits=4:vbits=2{SMALL}",
             f"snapkv:quant=token:kbits=16:vbits=4{SMALL}", f"snapkv:quant=kivi:bits=profile{SMALL}",
             f"ripplekv:quant=kivi:bits=profile:avgbits=6{SMALL}", f"snapkv:split=adakv:quant=kivi:bits=profile{SMALL}",
             f"kivi:bits=profile{SMALL}", f"kivi:kbits=8:vbits=2{SMALL}"]


@pytest.mark.parametrize("budget", [24, 80])
def test_every_variant_spends_the_budgets_bytes_within_the_stated_rounding(state, budget, profile):
    target = budget_bytes(state, budget)
    d, element = state.keys[0].shape[-1], state.keys[0].element_size()
    full_entry = 2 * d * element
    assert target == state.num_layers * state.num_kv_heads * budget * full_entry  # B full-precision entries
    for spec in ("snapkv", "pyramidkv", "snapkv:split=adakv"):  # eviction alone: exactly the budget
        method = make_method(spec)
        counts = method.budgets(state, budget)
        assert kept_bytes(state, counts) == independent_bytes(method.compress(state, budget), element, None, 1, 0, True)
        assert kept_bytes(state, counts) == target, spec
    for spec in QUANTIZED:
        method = make_method(spec, shared={"allocation": profile})
        q = method.quantizer
        if method.infeasible(state, budget):  # quantization alone, where every entry does not fit: refused
            assert not method.evicts and budget == 24, spec
            with pytest.raises(UserError):
                method.budgets(state, budget)
            continue
        counts = method.budgets(state, budget)
        layers = method.compress(state, budget)
        assert [layer.counts.tolist() for layer in layers] == counts.tolist()
        specs = stored_as(method, state, budget)
        bits = [(one.key_bits, one.value_bits) for one in specs]
        if "profile" not in spec:
            assert set(bits) == {(q.key_bits, q.value_bits)}, spec
        recorded = kept_bytes(state, counts, specs)
        assert recorded == independent_bytes(layers, element, bits, q.group, q.residual, q.key_axis == "channel"), spec
        slack = state.num_layers * state.num_kv_heads * 2 * full_entry  # the stated rounding
        assert recorded <= target, (spec, recorded, target)
        chosen = method.entry_budget(state, budget)
        if chosen < N:  # the most entries the bytes allow (one more step does not fit); else all of them, under it
            assert target - slack < recorded, (spec, recorded, target)
            assert kept_bytes(state, method.inner.budgets(state, chosen + 1), specs) > target, spec
        if q.residual < chosen and method.evicts:
            assert counts.sum() > state.num_layers * state.num_kv_heads * budget, spec  # more entries than eviction
        if q.residual < chosen and bits[0][1] < 16:
            assert levels_within(layers[0], bits[0][1], q.group, q.residual), spec


def test_bits_from_the_profile_spend_the_bytes_on_the_sensitive_layers(state, profile):
    """`kivi:bits=profile` keeps every entry; the greedy's bits rise with the layer's sensitivity, fit budget B's
    bytes, and no single further upgrade would; with eviction, `avgbits` fixes the average bits per layer."""
    method = make_method(f"kivi:bits=profile{SMALL}", shared={"allocation": profile})
    target = budget_bytes(state, 80)
    specs = method.layer_specs(state, 80)
    bits = [one.key_bits for one in specs]
    assert [one.value_bits for one in specs] == bits  # keys and values alike
    by_sensitivity = [bits[layer] for layer in sorted(range(4), key=lambda layer: SENSITIVITY[layer])]
    assert by_sensitivity == sorted(by_sensitivity) and bits[1] > bits[2]  # layer 1 most sensitive, 2 least
    counts = method.budgets(state, 80)
    assert int(counts.min()) == N and kept_bytes(state, counts, specs) <= target
    for layer, width in enumerate(bits):
        if width < 16:
            upgraded = list(specs)
            upgraded[layer] = method.quantizer.at({2: 4, 4: 8, 8: 16}[width])
            assert kept_bytes(state, counts, upgraded) > target, (layer, bits)
    assert make_method(f"kivi:bits=2{SMALL}").infeasible(state, 24) and method.infeasible(state, 24).startswith(
        "every entry at 2 bits in every layer")
    evicting = make_method(f"snapkv:quant=kivi:bits=profile:avgbits=5{SMALL}", shared={"allocation": profile})
    widths = [one.key_bits for one in evicting.layer_specs(state, 40)]
    assert sum(widths) <= 5 * 4 and widths[1] == max(widths) and widths[2] == min(widths)


def test_quantization_alone_is_feasible_only_where_every_entry_fits(state):
    method = make_method("kivi:bits=2:group=8:residual=16")
    small, large = 24, 120
    why = method.infeasible(state, small)
    assert why is not None and "every entry at 2 bits" in why
    with pytest.raises(UserError, match="kivi"):
        method.budgets(state, small)  # never silently over budget
    assert method.infeasible(state, large) is None
    counts = method.budgets(state, large)
    assert int(counts.min()) == N  # every entry, quantized
    assert kept_bytes(state, counts, stored_as(method, state, large)) <= budget_bytes(state, large)


def test_quantized_entries_leave_the_prefill_intact_and_the_residual_exact(state):
    keys = [k.clone() for k in state.keys]
    method = make_method("kivi:bits=2:group=8:residual=16")
    layers = method.compress(state, 140)
    assert all(torch.equal(a, b) for a, b in zip(keys, state.keys))
    for layer, full in zip(layers, keys):
        assert torch.equal(layer.keys[:, -16:], full[:, -16:])  # the last 16 positions untouched
        assert not torch.equal(layer.keys[:, :-16], full[:, :-16])


def test_eviction_methods_are_unchanged_by_the_memory_axis(state):
    counts = make_method("snapkv").budgets(state, 48)
    assert int(counts.sum()) == state.num_layers * state.num_kv_heads * 48


@pytest.mark.slow  # a whole eval command, end to end
def test_eval_records_bytes_lists_infeasible_variants_and_writes_the_memory_table(tiny_model_dir, tmp_path, run_cli,
                                                                                   eval_plots):
    """`eval --methods snapkv,kivi:bits=4,snapkv:quant=kivi:bits=4`: every line records its bytes, equal within the
    rounding at a budget; quantization alone where it does not fit is a line saying so, with no numbers, and is
    listed as infeasible in memory_axis.csv, never ranked."""
    import json

    import pandas as pd

    small = ":group=8:residual=16"
    methods = ["snapkv", f"kivi:bits=4{small}", f"snapkv:quant=kivi:bits=4{small}"]
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", ",".join(methods), "--budget", "32", "--budget", "200",
                           "--batch-size", "4", "--out", str(out))
    assert code == 0, err
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    by = {(line["method"], line["budget"]): line for line in lines}
    n = by[("full", None)]["compressed_tokens"]
    assert n > 200
    d, element, heads, layers = 8, 4, 2, 4  # tiny_model_dir: hidden 32 over 4 heads, 2 KV heads, float32
    assert by[("full", None)]["kv_bytes"] == layers * heads * n * 2 * d * element
    for budget in (32, 200):
        target = layers * heads * budget * 2 * d * element
        assert by[("snapkv", budget)]["kv_bytes"] == target
        line = by[(methods[2], budget)]
        assert line["kv_budget_bytes"] == target and line["kv_bytes"] <= target
        assert line["kept_entries"] > by[("snapkv", budget)]["kept_entries"]  # more entries at fewer bits
    tight = by[(methods[2], 32)]  # fewer than all entries: within the stated rounding of the budget
    assert 32 * 4 * 2 * (2 * d * element) - layers * heads * 2 * (2 * d * element) < tight["kv_bytes"]
    assert by[(methods[2], 200)]["kept_entries"] == layers * heads * n  # all of them fit, under the budget
    refused = by[(methods[1], 32)]
    assert "infeasible" in refused and refused["kl"] is None and "kept_entries" not in refused
    fits = by[(methods[1], 200)]
    assert "infeasible" not in fits and fits["kept_entries"] == layers * heads * n and fits["kv_bytes"] <= fits["kv_budget_bytes"]
    board = pd.read_csv(out / "leaderboard.csv")
    assert not ((board["method"] == methods[1]) & (board["budget"] == 32)).any()  # never ranked
    memory = pd.read_csv(out / "memory_axis.csv")
    row = memory[(memory["method"] == methods[1]) & (memory["budget"] == 32)].iloc[0]
    assert row["infeasible"].startswith("1 samples: every entry at 4 bits") and pd.isna(row["kl"])
    quantized = memory[(memory["method"] == methods[2]) & (memory["budget"] == 200)].iloc[0]
    assert quantized["bits"] == 4 and quantized["kl"] == pytest.approx(by[(methods[2], 200)]["kl"])
    assert "## Memory axis" in (out / "summary.md").read_text() and (out / "memory_axis.png").is_file()
    code, _, err = run_cli("score", str(out / "predictions.jsonl"))  # the infeasible lines have nothing to score
    assert code == 0, err


def test_a_layer_quantizes_each_heads_entries_in_prompt_order_whatever_their_counts(state):
    """quantize_layer on heads that keep different numbers of entries (AdaKV's split) is `quantize_head` on each
    head's real entries sorted by position; padding is left as it was."""
    from ripplekv.engine.quantize import QuantSpec, quantize_head
    from ripplekv.methods.core.quantized import quantize_layer

    spec = QuantSpec(bits=2, group=8, residual=16)
    layers = make_method("snapkv:split=adakv").compress(state, 48)
    for layer in layers:
        built = quantize_layer(layer, spec)
        for head, count in enumerate(layer.counts.tolist()):
            order = layer.positions[head, :count].argsort()
            want_k, want_v = quantize_head(layer.keys[head, order], layer.values[head, order], spec)
            assert torch.equal(built.keys[head, order], want_k) and torch.equal(built.values[head, order], want_v)
            assert torch.equal(built.keys[head, count:], layer.keys[head, count:])


def test_the_python_api_reports_the_bytes_a_quantized_cache_keeps():
    import ripplekv

    model = tiny_llama(num_hidden_layers=2)
    ids = (torch.arange(200) % 97 + 3).tolist()
    layers, heads, d, element = 2, 2, 16, 4
    budget_bytes_ = layers * heads * 40 * 2 * d * element
    plain = ripplekv.compress(model, None, ids, method="snapkv", budget=40)
    assert plain.kv_bytes == budget_bytes_
    cache = ripplekv.compress(model, None, ids, method="snapkv:quant=kivi:bits=4:group=8:residual=16", budget=40)
    assert cache.kept_entries > plain.kept_entries
    assert budget_bytes_ - layers * heads * 2 * (2 * d * element) < cache.kv_bytes <= budget_bytes_
    out = model.generate(cache.input_ids, cache=cache, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == cache.input_ids.shape[1] + 4  # it decodes through the dequantized entries
    with pytest.raises(UserError, match="infeasible|over budget"):
        ripplekv.compress(model, None, ids, method="kivi:bits=4", budget=40)


def test_a_variant_with_fewer_samples_has_its_n_and_sits_apart_unranked():
    import numpy as np
    import pandas as pd

    from ripplekv.analysis.memory_axis import memory_markdown, memory_table

    lines = [{"task": "niah", "id": f"s{i}", "method": method, "budget": 256, "kept_entries": 10, "kv_bytes": 100,
              "kv_budget_bytes": 100, "kl": kl} for method, kl, count in (("snapkv", 0.5, 6), ("kivi:bits=2", 0.1, 1))
             for i in range(count)]
    board = pd.DataFrame({"method": ["snapkv", "kivi:bits=2"], "budget": [256, 256], "kl": [0.5, 0.1],
                          "kl_ci_low": [0.4, np.nan], "kl_ci_high": [0.6, np.nan], "kl_ratio_vs_uniform": [1.0, 0.2],
                          "kl_ratio_ci_low": [1.0, np.nan], "kl_ratio_ci_high": [1.0, np.nan]})
    specs = {"snapkv": {}, "kivi:bits=2": {"quantizer": {"bits": 2}}}
    table = memory_table(pd.DataFrame(lines), board, specs)
    assert list(table["method"]) == ["snapkv", "kivi:bits=2"]  # the lower KL of one sample is not ranked first
    assert list(table["n"]) == [6, 1] and list(table["fewer_samples"]) == [False, True]
    ranked, apart = memory_markdown(table).split("Rows with fewer samples than the table's n (6), not ranked:")
    assert "| 256 | snapkv | 6 |" in ranked and "kivi" not in ranked and "| 256 | kivi:bits=2 | 1 | 2 |" in apart
    assert "nan" not in apart  # a one-sample row has no interval to show
