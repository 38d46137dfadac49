"""The cross-layer allocators (DynamicKV, LAVa, SqueezeAttention, PyramidInfer, CompressKV) and the allocation
ceiling, each against a hand-written computation of its budgets from a tiny model's eager attention maps or
hidden states (not a call into the code under test)."""

import itertools
import math

import numpy as np
import pytest
import torch

from ripplekv import defaults
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.budgets import integer_budgets
from tests.conftest import satisfy, tiny_llama

NEW = ("dynamickv", "lava", "squeezeattention", "pyramidinfer", "compresskv", "allocation-ceiling")
LAYERS, LENGTH = 6, 160


@pytest.fixture(scope="module")
def eager():
    """(model, prompt ids, eager attention maps [L][H_q, n, n], hidden states entering each layer [L][n, D],
    the residual after each layer's attention [L][n, D], values [L][H_kv, n, d]), float64 where computed."""
    model = tiny_llama(num_hidden_layers=LAYERS, seed=5)
    with torch.no_grad():  # sharper attention deeper down, so the layers' statistics differ
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.weight.mul_(1 + 2 * index)
            layer.self_attn.k_proj.weight.mul_(1 + 2 * index)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 101, (LENGTH,), generator=torch.Generator().manual_seed(3))
    after = {}
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda module, args, index=index: after.__setitem__(index, args[0][0].double()))
        for index, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        out = model(input_ids=ids[None], output_attentions=True, output_hidden_states=True, use_cache=True)
    for hook in hooks:
        hook.remove()
    maps = [a[0].double() for a in out.attentions]
    hidden = [h[0].double() for h in out.hidden_states[:LAYERS]]
    values = [out.past_key_values.layers[i].values[0].double() for i in range(LAYERS)]
    return model, ids, maps, hidden, [after[i] for i in range(LAYERS)], values


def prefilled(model, ids, window=64):
    return satisfy(prefill_for(model, ids, Requirements(capture_window=window)))


def pool(rows: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """1-D pooling of each row, stride 1, zero padding of kernel // 2 counted in averages (as SnapKV does)."""
    pad = kernel // 2
    padded = torch.nn.functional.pad(rows, (pad, pad), value=0.0 if kind == "avg" else float("-inf"))
    windows = torch.stack([padded[..., i : i + rows.shape[-1]] for i in range(kernel)])
    return windows.mean(0) if kind == "avg" else windows.amax(0)


def test_methods_lists_the_new_allocators(run_cli):
    code, out, _ = run_cli("methods")
    assert code == 0 and all(name in out for name in NEW)
    assert "allocation-ceiling" in defaults.CEILINGS
    assert make_method("allocation-ceiling").allocator.knows_answer is True


@pytest.mark.parametrize("name", NEW)
def test_each_keeps_exactly_snapkvs_entry_count_at_every_budget(eager, name):
    model, ids, *_ = eager
    state = prefilled(model, ids)
    method = make_method(name, **({"errors": (1.0, 3.0, 2.0, 0.5, 0.0, 4.0)} if name == "compresskv" else {}))
    snapkv = make_method("snapkv")
    for budget in (1, 8, 16, 33, 40, 64, 100, 159, 160, 500):
        counts = method.budgets(state, budget)
        assert counts.sum() == snapkv.budgets(state, budget).sum() == LAYERS * 2 * min(budget, LENGTH)
        assert counts.max() <= LENGTH and counts.min() >= 0
        assert [layer.total() for layer in method.compress(state, budget)] == counts.sum(1).tolist()


def test_dynamickv_budgets_follow_a_global_top_k_of_the_eager_attention(eager):
    model, ids, maps, *_ = eager
    window, budget = 8, 40
    scores = []
    for attention in maps:  # [H_q, n, n]: the window rows, summed, prefix, pooled per query head
        mass = attention[:, LENGTH - window :, : LENGTH - window].sum(1)
        scores.append(pool(mass, 7, "avg"))
    flat = sorted(((float(s), layer) for layer, layer_scores in enumerate(scores) for s in layer_scores.reshape(-1)),
                  reverse=True)
    hits = np.bincount([layer for _, layer in flat[: LAYERS * 4 * (budget - window)]], minlength=LAYERS)
    targets = [window + LAYERS * (budget - window) * h / hits.sum() for h in hits]
    expected = integer_budgets(targets, budget, min(LENGTH, window + 10 * (budget - window)), window)
    counts = make_method("dynamickv").budgets(prefilled(model, ids), budget)
    assert counts[:, 0].tolist() == expected and (counts == counts[:, :1]).all() and len(set(expected)) > 1
    # composed with SnapKV's scorer: the same signal, SnapKV's window (32) as every layer's floor
    hits_at_32 = make_method("dynamickv:scorer=snapkv").budgets(prefilled(model, ids), 64)[:, 0]
    assert hits_at_32.min() >= 32 and hits_at_32.sum() == LAYERS * 64


def test_lava_layer_budgets_follow_the_entropy_of_value_weighted_attention(eager):
    model, ids, maps, _, _, values = eager
    window, budget, group = 32, 64, 2
    sparsity = []
    for attention, value in zip(maps, values):
        mean = attention[:, LENGTH - window :, : LENGTH - window].mean(1)  # [H_q, m]
        largest = value[:, : LENGTH - window].abs().sum(-1).amax(-1)  # [H_kv]
        weighted = torch.stack([pool(mean[h], 7, "max") * largest[h // group] for h in range(4)])
        per_kv = torch.stack([weighted[2 * k : 2 * k + 2].amax(0) for k in range(2)]).reshape(-1)
        p = per_kv / per_kv.sum()
        sparsity.append(float(-(p * p.log()).sum()) / math.log(p.numel()))
    shares = [s / sum(sparsity) for s in sparsity]
    expected = integer_budgets([window + LAYERS * (budget - window) * s for s in shares], budget, LENGTH, window)
    method = make_method("lava")
    state = prefilled(model, ids)
    assert method.allocator.sparsities(state) == pytest.approx(sparsity, rel=1e-4)
    counts = method.budgets(state, budget)
    assert (counts.sum(1) // 2).tolist() == expected and (counts.sum(1) % 2 == 0).all() and len(set(expected)) > 2
    assert (counts >= window).all() and (counts != counts[:, :1]).any()  # heads compete inside a layer
    even = make_method("lava:split=even").budgets(state, budget)
    assert even[:, 0].tolist() == expected and (even == even[:, :1]).all()


def best_three_groups_by_enumeration(values):
    """The 3-group assignment (every group non-empty) with the least within-group squared error, by trying all."""
    best = None
    for labels in itertools.product(range(3), repeat=len(values)):
        if len(set(labels)) < 3:
            continue
        cost = sum(((values[np.array(labels) == g] - values[np.array(labels) == g].mean()) ** 2).sum() for g in range(3))
        if best is None or cost < best[0] - 1e-12:
            best = (cost, np.array(labels))
    labels = best[1]
    centres = [values[labels == g].mean() for g in range(3)]
    return labels == int(np.argmax(centres))


def test_squeezeattention_groups_layers_by_the_cosine_of_the_residual_stream(eager):
    model, ids, _, hidden, after, _ = eager
    tokens, budget, p = 64, 48, 0.38
    cosines = np.array([float(torch.nn.functional.cosine_similarity(h[-tokens:], a[-tokens:], dim=-1).mean())
                        for h, a in zip(hidden, after)])
    method = make_method("squeezeattention")
    state = prefilled(model, ids)
    assert method.allocator.cosines(state) == pytest.approx(cosines.tolist(), abs=1e-4)
    least = best_three_groups_by_enumeration(cosines)
    rest = (LAYERS - least.sum() * p) / (LAYERS - least.sum())
    expected = integer_budgets([p if flag else rest for flag in least], budget, LENGTH, 1)
    counts = method.budgets(state, budget)
    assert counts[:, 0].tolist() == expected and len(set(expected)) > 1
    assert min(expected[i] for i in np.flatnonzero(least)) < budget < max(expected)


def test_pyramidinfer_budgets_compound_the_cosine_schedule_and_its_scorer_averages_all_heads(eager):
    model, ids, maps, *_ = eager
    budget, window = 64, 32
    rho = [0.1 * (math.cos(math.pi * i / LAYERS) + 1) / 2 + 0.9 for i in range(LAYERS)]
    kept = [math.prod(rho[:layer]) for layer in range(LAYERS)]
    targets = [window + LAYERS * (budget - window) * k / sum(kept) for k in kept]
    method = make_method("pyramidinfer")
    assert method.layer_budgets(LAYERS, budget, LENGTH) == integer_budgets(targets, budget, LENGTH, window)
    masks = method.select(prefilled(model, ids), budget)
    counts = method.layer_budgets(LAYERS, budget, LENGTH)
    for layer, attention in enumerate(maps):
        score = attention[:, LENGTH - window :, : LENGTH - window].mean((0, 1))
        score[:4] = float("inf")
        top = set(torch.argsort(score, descending=True)[: counts[layer] - window].tolist())
        for head in range(2):
            assert set(masks[layer, head, : LENGTH - window].nonzero().flatten().tolist()) == top
            assert masks[layer, head, LENGTH - window :].all()


def test_compresskv_profiles_the_relative_output_error_and_budgets_by_it(eager, tmp_path):
    from ripplekv.methods.compresskv import calibrate, layer_errors, write_profile

    model, ids, maps, _, _, values = eager
    budget, window = 40, 32
    state = prefilled(model, ids)
    selection = make_method("snapkv").select(state, budget)
    expected = []
    for layer, (attention, value) in enumerate(zip(maps, values)):
        rows = attention[:, LENGTH - window :]  # [H_q, w, n]
        kept = selection[layer].double()[torch.arange(4) // 2][:, None, :]
        restricted = rows * kept / (rows * kept).sum(-1, keepdim=True)
        project = model.model.layers[layer].self_attn.o_proj.weight.detach().double()  # [D, H_q * d]

        def output(weights, value=value, project=project):
            heads = torch.stack([weights[h] @ value[h // 2] for h in range(4)])  # [H_q, w, d]
            return heads.transpose(0, 1).reshape(window, -1) @ project.T

        full = output(rows)
        expected.append(float(torch.linalg.norm(output(restricted) - full) / (torch.linalg.norm(full) + 1e-5)))
    assert layer_errors(state, budget, window) == pytest.approx(expected, rel=1e-3)
    errors = calibrate(model, [ids[:100].tolist(), ids.tolist()], budget, window)
    profile = write_profile(tmp_path / "errors.csv", errors)
    method = make_method(f"compresskv:profile={profile}")
    assert method.label == "compresskv:profile=errors.csv"
    spare = LAYERS * (64 - 32)
    targets = [32 + spare * e / sum(errors) for e in errors]
    assert method.layer_budgets(LAYERS, 64, LENGTH) == integer_budgets(targets, 64, min(LENGTH, 3 * 64), 32)
    with pytest.raises(UserError, match="needs a layer error profile"):
        make_method("compresskv")
    with pytest.raises(UserError, match="has 6 layers but the model has 4"):
        method.layer_budgets(4, 64, LENGTH)


def test_allocation_ceiling_gives_the_answers_most_attended_entries_to_their_layers_and_heads(eager):
    from ripplekv.methods.oracle import answer_attention

    model, ids, *_ = eager
    state = prefilled(model, ids)
    budget, window = 48, 32
    scores = answer_attention(state)[:, :, : LENGTH - window]  # the oracle's scores (tested in test_frontier)
    triples = sorted(((float(scores[l, h, i]), l, h) for l in range(LAYERS) for h in range(2)
                      for i in range(LENGTH - window)), reverse=True)[: LAYERS * 2 * (budget - window)]
    expected = np.full((LAYERS, 2), window)
    for _, layer, head in triples:
        expected[layer, head] += 1
    method = make_method("allocation-ceiling")
    counts = method.budgets(state, budget)
    assert counts.tolist() == expected.tolist() and counts.sum() == LAYERS * 2 * budget
    assert len(set(counts.reshape(-1).tolist())) > 1
    with pytest.raises(UserError, match="only in `ripplekv eval`"):
        make_method("allocation-ceiling").budgets(prefill_for(model, ids[:100], Requirements(capture_window=64)), budget)


def test_options_are_checked_in_one_line():
    for spec, message in [("dynamickv:ratio_max=0.5", "ratio_max must be a number >= 1"),
                          ("squeezeattention:p=0", "p must be in"), ("pyramidinfer:decay=1.5", "decay must be in"),
                          ("allocation-ceiling:split=adakv", "splits heads itself"),
                          ("lava:pooling=mean", "unknown pooling")]:
        with pytest.raises(UserError, match=message):
            make_method(spec)
    for name in ("dynamickv", "lava", "squeezeattention", "allocation-ceiling"):
        with pytest.raises(UserError, match="depend on each"):
            make_method(name).layer_budgets(30, 128, 3500)


@pytest.mark.slow
def test_eval_runs_the_allocators_with_snapkvs_scorer_and_reports_the_allocation_table(tiny_model_dir, tmp_path, run_cli):
    import json

    import pandas as pd

    profile = tmp_path / "errors.csv"
    profile.write_text("layer,error\n0,0.4\n1,0.1\n2,0.2\n3,0.3\n")
    specs = ["full", "uniform", "dynamickv:scorer=snapkv", "lava:scorer=snapkv", "squeezeattention:scorer=snapkv",
             "pyramidinfer:scorer=snapkv", f"compresskv:profile={profile}", "allocation-ceiling", "streamingllm"]
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", ",".join(specs), "--budget", "40", "--budget", "64",
                           "--batch-size", "8", "--out", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    for budget in (40, 64):
        kept = {r["kept_entries"] for r in rows if r["budget"] == budget}
        assert len(kept) == 1  # every allocator keeps exactly the uniform total
    table = pd.read_csv(out / "allocation_only.csv")
    assert set(table["method"]) == {"uniform", "dynamickv:scorer=snapkv", "lava:scorer=snapkv", "squeezeattention:scorer=snapkv",
                                    "pyramidinfer:scorer=snapkv", "compresskv:profile=errors.csv", "allocation-ceiling",
                                    "best-of-allocations", "cross-fit choice"}  # analysis.allocation's HINDSIGHT, CROSS_FIT
    assert (table.loc[table["method"] == "allocation-ceiling", "kind"] == "answer-aware").all()
    for _, at in table.groupby("budget"):  # no allocation is closer to the full cache than the hindsight best
        best = at.loc[at["method"] == "best-of-allocations", "kl"].item()
        assert (at["kl"].dropna() >= best - 1e-12).all()  # one sample: nothing to cross-fit (NaN)
    board = pd.read_csv(out / "leaderboard.csv")
    assert board.loc[board["method"] == "allocation-ceiling", "rank"].isna().all()


def test_check_references_rules_for_dynamickv_and_lava_agree_with_ours_on_the_eager_attention(tmp_path):
    """The check-references core on the main venv: the reference-side signals from HF's eager attention (what
    its worker hook records), each reference's budget rule on them, and the comparison line against ours."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from check_references_allocators import (
        compare_allocators,
        dynamickv_budgets,
        dynamickv_exact,
        lava_budgets,
        signals,
    )

    from ripplekv.analysis.kept import kept_arrays

    model = tiny_llama(num_hidden_layers=8, seed=2)
    with torch.no_grad():  # sharper attention deeper down, so the layers' entropies differ
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.weight.mul_(1 + 2 * index)
            layer.self_attn.k_proj.weight.mul_(1 + 2 * index)
    model.set_attn_implementation("eager")
    n, layers, budgets = 400, 8, [40, 128]
    ids = torch.randint(0, 101, (1, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, use_cache=True)
    reference = {}
    for layer in range(layers):
        reference.update(signals(layer, out.attentions[layer], out.past_key_values.layers[layer].values, n))
    np.savez(tmp_path / "reference_prompt_0.npz", **reference)
    state = prefill_for(model, ids[0], Requirements(capture_window=64))
    arrays = {}
    for name in ("dynamickv", "lava"):
        for budget in budgets:
            arrays[f"{name}/{budget}/counts"] = kept_arrays(make_method(name).compress(state, budget))["counts"]
    np.savez(tmp_path / "ours_prompt_0.npz", **arrays, meta=json.dumps({"tokens": n}))
    scores = [reference[f"dynamickv_scores/{i}"] for i in range(layers)]
    theirs, exact = dynamickv_budgets(scores, 128, n), dynamickv_exact(scores, 128, n)
    assert theirs.sum() == exact.sum() == layers * 128 and len(set(exact.tolist())) > 1
    assert theirs[-1] > exact[-1]  # its code piles the remainders of its truncations on the last layer
    assert np.abs(arrays["dynamickv/128/counts"][:, 0] - exact).max() <= 1  # ours: the rule, largest remainder
    sparsity = np.asarray([float(reference[f"lava_sparsity/{i}"]) for i in range(layers)])
    assert lava_budgets(sparsity, 128).sum() <= layers * 128  # truncation: the reference keeps a few fewer
    assert len(set(lava_budgets(sparsity, 128).tolist())) > 2
    lines = compare_allocators([tmp_path / "ours_prompt_0.npz"], lambda path: np.load(tmp_path / "reference_prompt_0.npz"),
                               layers, budgets)
    assert [name for name, _, _ in lines] == ["dynamickv", "lava"]
    assert all(ok for _, ok, _ in lines), [text for _, _, text in lines]


def test_check_references_dynamickv_rule_caps_a_dominant_layer_and_spreads_its_excess():
    """The check's exact DynamicKV rule when one layer holds every top score: capped at radio_max x base, the
    excess spread over the other layers in proportion (as our integer budgets do), L x B in all."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from check_references_allocators import dynamickv_exact

    layers, budget, length, window = 12, 40, 2000, 8
    rng = np.random.default_rng(0)
    scores = [rng.uniform(0, 0.1, (4, length - window)) for _ in range(layers)]
    scores[0] += 1.0  # layer 0 wins the whole top-k: 12 x base hits, over the 10 x base cap
    exact = dynamickv_exact(scores, budget, length)
    cap = window + 10 * (budget - window)
    assert exact[0] == cap and exact.sum() == layers * budget
    expected = integer_budgets([window + layers * (budget - window) * (i == 0) for i in range(layers)], budget, cap, window)
    assert np.abs(exact - np.asarray(expected)).max() <= 1 and exact[1:].min() > window


def test_global_layers_first_fills_the_layers_that_read_the_whole_prompt_before_the_sliding_ones():
    from ripplekv.methods.global_first import global_first_budgets

    caps, length = [15, 15, 15, 15, 15, 90], 90  # five sliding layers holding 15 entries, one global layer
    assert global_first_budgets(caps, length, 20, 4) == [6, 6, 6, 6, 6, 90]  # floors 4, the global layer full, +2 each
    assert global_first_budgets(caps, length, 10, 4) == [4, 4, 4, 4, 4, 40]  # the global layer takes all it can
    assert global_first_budgets(caps, length, 40, 4) == caps  # more than every layer holds: all of it
    for budget in range(1, 30):
        counts = global_first_budgets(caps, length, budget, 4)
        assert sum(counts) == min(6 * budget, sum(caps)) and all(c <= cap for c, cap in zip(counts, caps))
    assert global_first_budgets([90] * 4, 90, 20, 4) == [20] * 4  # no sliding layer: uniform
