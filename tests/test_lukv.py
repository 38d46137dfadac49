"""LU-KV: its greedy against a brute-force optimum, its curve file, its exact budgets and kvpress's rounding."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from ripplekv.engine.prefill import prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.lukv.greedy import RATIOS, eviction_costs, greedy_evictions, head_floor, hull_slopes, prune_ratios
from ripplekv.methods.lukv.method import exact_counts, keep_shares, kvpress_counts, read_curve, scorer_identity
from ripplekv.methods.lukv.oracle import prompt_curves
from ripplekv.pipeline.head_curves import write_curve
from tests.conftest import tiny_llama


def hull_by_brute_force(costs: np.ndarray) -> np.ndarray:
    """The greatest convex minorant of k -> costs[:k].sum() at every k: the lowest chord through k."""
    cumulative = np.concatenate([[0.0], np.cumsum(costs)])
    size = len(cumulative)
    hull = cumulative.copy()
    for a in range(size):
        for b in range(a + 1, size):
            for k in range(a, b + 1):
                hull[k] = min(hull[k], cumulative[a] + (cumulative[b] - cumulative[a]) * (k - a) / (b - a))
    return hull


def test_hull_slopes_are_the_lower_convex_hull_of_the_cumulative_cost():
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = rng.exponential(size=rng.integers(1, 9))
        slopes = hull_slopes(costs)
        assert np.all(np.diff(slopes) >= -1e-12)  # marginal costs never decrease
        assert np.allclose(np.concatenate([[0.0], np.cumsum(slopes)]), hull_by_brute_force(costs))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_reaches_the_brute_force_optimum_of_the_relaxed_problem(seed):
    """Three heads of 9 entries (1 sink, 1 window): at every total number of evictions the greedy's relaxed loss is
    the least any split of that total over the heads reaches; where a head's costs are convex (its scorer ranks
    by the oracle itself) the relaxed loss is the true one."""
    rng = np.random.default_rng(seed)
    heads, length, sink, window = 3, 9, 1, 1
    importance = rng.exponential(size=(heads, length))
    scores = rng.normal(size=(heads, length))
    scores[0] = importance[0]  # head 0: evicting in the oracle's own order, its costs are convex
    costs = [eviction_costs(importance[h], scores[h], sink, window) for h in range(heads)]
    hulls = [np.concatenate([[0.0], np.cumsum(hull_slopes(c))]) for c in costs]
    truth = [np.concatenate([[0.0], np.cumsum(c)]) for c in costs]
    assert np.allclose(hulls[0], truth[0])
    limit = length - head_floor(length, sink, window)
    totals = list(range(heads * limit + 1))
    evicted = greedy_evictions([hull_slopes(c) for c in costs], [limit] * heads, totals)
    for total, counts in zip(totals, evicted):
        assert counts.sum() == total and counts.max() <= limit
        best = min(sum(hulls[h][k] for h, k in enumerate(split))
                   for split in itertools.product(range(limit + 1), repeat=heads) if sum(split) == total)
        assert sum(hulls[h][k] for h, k in enumerate(counts)) == pytest.approx(best, abs=1e-12)
    assert (np.diff(evicted, axis=0) >= 0).all()  # nested: a head never takes an eviction back


def test_prune_ratios_evict_the_global_share_of_every_row_and_respect_the_floor():
    rng = np.random.default_rng(1)
    layers, heads, length = 2, 2, 200
    importance, scores = rng.exponential(size=(2, layers, heads, length))
    curve = prune_ratios(importance, scores, sink=4, window=1)
    assert curve.shape == (99, layers, heads)
    evicted = np.round(curve * length).sum(axis=(1, 2))
    assert np.array_equal(evicted[:90], np.round(RATIOS[:90] * layers * heads * length))
    assert curve.max() <= 1 - 5 / length + 1e-12  # 4 sinks + 1 window never go
    per_layer = prune_ratios(importance, scores, sink=4, window=1, layerwise=False)
    assert np.allclose(np.round(per_layer * length).sum(axis=2)[:90], np.round(RATIOS[:90, None] * heads * length))


def test_exact_counts_follow_the_curve_and_sum_to_l_x_h_x_b():
    rng = np.random.default_rng(2)
    curve = np.sort(rng.uniform(size=(99, 3, 2)), axis=0)
    curve = curve * (RATIOS[:, None, None] / curve.mean(axis=(1, 2), keepdims=True))
    curve = np.clip(curve, 0, 0.999)
    for budget, length in [(128, 809), (40, 300), (300, 301), (500, 400), (3, 809)]:
        counts = exact_counts(curve, budget, length, floor=min(5, budget))
        assert counts.sum() == 6 * min(budget, length) and counts.min() >= min(5, budget) and counts.max() <= length
    mild = np.clip(curve, 0, 0.8)  # no head near its floor: the counts are the shares rounded
    shares = keep_shares(mild, 1 - 128 / 809)
    counts = exact_counts(mild, 128, 809, floor=5)
    assert np.abs(counts - shares * 6 * 128 / shares.sum()).max() < 1
    assert np.allclose(keep_shares(curve, 0.42), 1 - curve[41]) and np.allclose(keep_shares(curve, 0.005), 1 - curve[0] / 2)


def test_kvpress_rounding_reads_the_nearest_percent_row_per_layer():
    curve = np.zeros((99, 1, 3))
    curve[83, 0] = [0.9, 0.8, 0.82]  # rho = 1 - 128/809 = 0.842 -> row round(84.2) - 1 = 83
    counts = kvpress_counts(curve, 128, 809)
    ideal = (1 - curve[83, 0]) * 809  # 80.9, 161.8, 145.62: floors 80, 161, 145; round(388.32) = 388: 2 more
    assert ideal.sum() == pytest.approx(388.32)
    assert counts.tolist() == [[81, 162, 145]]  # the leftover 2 to the largest fractions (0.9, 0.8)
    assert kvpress_counts(curve, 900, 809).tolist() == [[809, 809, 809]]


def test_a_curve_file_round_trips_and_a_bad_one_is_one_line(tmp_path):
    curve = np.random.default_rng(3).uniform(size=(99, 2, 2)).round(6)
    path = write_curve(tmp_path / "curve.csv", curve, {"scorer": {"name": "snapkv"}})
    again, provenance = read_curve(path)
    assert np.allclose(again, curve) and provenance == {"scorer": {"name": "snapkv"}}
    lines = path.read_text().splitlines()
    (tmp_path / "short.csv").write_text("\n".join(lines[:-1]) + "\n")
    (tmp_path / "columns.csv").write_text("ratio,layer,prune\n0.01,0,0.1\n")
    for name, message in [("short.csv", "one row per ratio"), ("columns.csv", "expected ratio,layer,head,prune"),
                          ("missing.csv", "does not exist")]:
        with pytest.raises(UserError, match=message):
            read_curve(tmp_path / name)
    with pytest.raises(UserError, match="must lie in"):
        (tmp_path / "range.csv").write_text("\n".join(lines[:2] + [lines[2].rsplit(",", 1)[0] + ",1.5"] + lines[3:]) + "\n")
        read_curve(tmp_path / "range.csv")


def tiny_curve(tmp_path, spec: str, layers: int = 4, heads: int = 2):
    """A synthetic curve (deeper layers prune more) for `spec`'s scorer on a tiny model."""
    depth = np.linspace(0.6, 1.4, layers)[None, :, None] * np.linspace(0.9, 1.1, heads)[None, None, :]
    curve = np.clip(RATIOS[:, None, None] * depth, 0, 0.98)
    name = spec.replace(":", "-") + f"-{layers}"
    return write_curve(tmp_path / f"{name}.csv", curve, {"scorer": scorer_identity(make_method(spec).scorer)})


def test_lukv_keeps_exactly_snapkvs_total_and_refuses_a_curve_of_another_scorer(tmp_path):
    model = tiny_llama(num_hidden_layers=4)
    ids = torch.randint(0, 101, (300,), generator=torch.Generator().manual_seed(0))
    ea, snap = tiny_curve(tmp_path, "lukv"), tiny_curve(tmp_path, "lukv:scorer=snapkv")
    methods = [make_method(s) for s in ("snapkv", f"lukv:curve={ea}", f"lukv:scorer=snapkv:curve={snap}")]
    state = prefill_for(model, ids, methods[0].requirements().union(methods[1].requirements()))
    for budget in (40, 128):
        assert [int(m.select(state, budget).sum()) for m in methods] == [4 * 2 * budget] * 3
        counts = methods[1].budgets(state, budget)
        assert len(set(counts.ravel().tolist())) > 1 and counts.min() >= 5  # head budgets differ; sinks + window kept
        kept = methods[1].select(state, budget)
        assert kept.sum(-1).numpy().tolist() == counts.tolist() and kept[..., :4].all() and kept[..., -1].all()
    with pytest.raises(UserError, match="fits only its scorer"):
        make_method(f"lukv:scorer=snapkv:curve={ea}")  # refused when built, before any model work
    with pytest.raises(UserError, match="fits only its scorer"):
        make_method(f"snapkv:allocator=lukv:curve={ea}").budgets(state, 40)  # another preset: when it allocates
    with pytest.raises(UserError, match="was fitted for 3 layers x 2 KV heads; the model has 4 layers x 2 KV heads"):
        make_method(f"lukv:curve={tiny_curve(tmp_path, 'lukv', layers=3)}").budgets(state, 40)
    with pytest.raises(UserError, match="lukv needs a budget curve"):
        make_method("lukv").budgets(state, 40)
    with pytest.raises(UserError, match="differ by head"):
        make_method(f"lukv:curve={ea}").layer_budgets(4, 40, 300)


def test_one_prompts_profile_gives_nested_curves_for_each_scorer(tokenizer):
    """The per-prompt protocol on a tiny model: one prefill, its greedy answer read back, one curve per scorer whose
    rows evict the global share of the prompt (protected entries counted) and never take an eviction back."""
    model = tiny_llama(vocab_size=len(tokenizer), seed=4)
    ids = torch.randint(0, len(tokenizer), (160,), generator=torch.Generator().manual_seed(1)).tolist()
    scorers = {m.scorer.name: m.scorer for m in (make_method("lukv"), make_method("lukv:scorer=snapkv"))}
    curves, answer = prompt_curves(model, tokenizer, ids, scorers, answer_tokens=6)
    assert 1 <= answer <= 6 and set(curves) == {"lukv", "snapkv"}
    for name, curve in curves.items():
        evicted = np.round(curve * len(ids))
        assert (np.diff(evicted, axis=0) >= 0).all()
        possible = 4 * 2 * (len(ids) - {"lukv": 5, "snapkv": 32}[name])
        assert np.array_equal(evicted.sum(axis=(1, 2)), np.minimum(np.round(RATIOS * 4 * 2 * len(ids)), possible))
    assert not np.allclose(curves["lukv"], curves["snapkv"])  # the scorer's order changes what the greedy sees
    json.dumps({n: c.tolist() for n, c in curves.items()})  # what the resumable log stores


@pytest.mark.slow
def test_eval_keeps_as_many_entries_for_lukv_as_for_snapkv_and_records_its_head_budgets(tiny_model_dir, tmp_path, run_cli):
    """`ripplekv eval --budget 40 --methods full,snapkv,lukv:curve=...`: the same total as SnapKV's, per-head budgets
    that differ, recorded per sample; a curve of another scorer is one line before any model work is lost."""
    curve = tiny_curve(tmp_path, "lukv", layers=4, heads=2)
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", f"full,snapkv,lukv:curve={curve}", "--budget", "40",
                           "--out", str(out))
    assert code == 0, err
    rows = {r["method"]: r for r in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    lukv = rows[f"lukv:curve={curve.name}"]
    assert lukv["kept_entries"] == rows["snapkv"]["kept_entries"] == 4 * 2 * 40
    assert len({b for layer in lukv["head_budgets"] for b in layer}) > 1


def test_lukv_with_a_head_split_keeps_its_layer_totals_and_splits_heads_that_way(tmp_path):
    """`lukv:split=even|adakv`: LU-KV's layer totals (its curve summed over a layer's heads), split over heads by
    the named rule; exactly L x H x B in all, so the factorial core can vary LU-KV's head split alone."""
    model = tiny_llama(num_hidden_layers=4)
    ids = torch.randint(0, 101, (300,), generator=torch.Generator().manual_seed(1))
    ea = tiny_curve(tmp_path, "lukv")
    own, even, ada = (make_method(f"lukv:curve={ea}{extra}") for extra in ("", ":split=even", ":split=adakv"))
    state = prefill_for(model, ids, own.requirements().union(ada.requirements()))
    for budget in (40, 128):
        per_head, evenly, adaptive = (m.budgets(state, budget) for m in (own, even, ada))
        assert int(evenly.sum()) == int(adaptive.sum()) == int(per_head.sum()) == 4 * 2 * budget
        assert (evenly == evenly[:, :1]).all()  # even: a layer's heads keep the same
        assert evenly.sum(1).tolist() == adaptive.sum(1).tolist()  # one set of layer totals under both splits
        assert len(set(evenly.sum(1).tolist())) > 1  # the curve's layers differ (deeper ones prune more)
        assert abs(evenly.sum(1) - per_head.sum(1)).max() <= 2  # the curve's own layer totals, up to rounding
        assert not (adaptive == adaptive[:, :1]).all()  # adakv: heads differ by their scores
        assert int(ada.select(state, budget).sum()) == 4 * 2 * budget
    with pytest.raises(UserError, match="takes no split="):
        make_method(f"lukv:curve={ea}:split=even:rounding=kvpress")


def test_the_shipped_curves_are_where_lukv_looks():
    """The bundled model's curves ship in ripplekv/data/lukv: lukv finds them wherever its module sits (a move into
    methods/lukv/ once left it looking in methods/data/)."""
    from ripplekv.methods.lukv.method import SHIPPED

    assert {"smollm2-135m-lukv.csv", "smollm2-135m-snapkv.csv"} <= {path.name for path in SHIPPED.glob("*.csv")}
