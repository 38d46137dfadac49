"""Threshold modes (`METHOD:threshold=TAU`, kvpress DMSPress; KVzap's threshold mode): the entries kept are exactly
those scoring at or above tau plus the window, recomputed here from the surrogate by hand; their bytes are those
entries'; reports never rank them among matched budgets and the memory axis places them at the bytes they spent."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from ripplekv.analysis import report
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.quantized import kept_bytes
from ripplekv.methods.kvzap import surrogate as kvzap_surrogate
from tests.conftest import tiny_llama
from tests.test_kvzap import tiny_weights
from tests.test_report import noisy_predictions, write

N, WINDOW = 200, 16


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return tiny_weights(tmp_path_factory.mktemp("kvzap"))


@pytest.fixture(scope="module")
def state(weights):
    model = tiny_llama()
    ids = torch.randint(0, 101, (N,), generator=torch.Generator().manual_seed(0))
    methods = [make_method(f"kvzap:weights={weights}"), make_method("snapkv")]
    return prefill_for(model, ids, Requirements.of_all(methods))


def hand_scores(state, weights) -> list[torch.Tensor]:
    """Each layer's surrogate applied by hand to the recorded hidden states: [H_kv, n] per layer."""
    layers, _ = kvzap_surrogate.load(weights)
    with torch.no_grad():
        return [layers[layer](state.signal("hidden_states")[layer].clone()).T.float() for layer in range(len(layers))]


def test_kvzap_threshold_keeps_exactly_what_scores_at_or_above_tau_plus_its_window(state, weights):
    scores = hand_scores(state, weights)
    prefix = torch.cat([s[:, : N - WINDOW].flatten() for s in scores])
    tau = float(prefix.median())  # about half the prefix passes: neither everything nor nothing
    method = make_method(f"kvzap:weights={weights}:window={WINDOW}:threshold={tau!r}")
    built = method.compress(state, 40)
    counts = method.budgets(state, 40)
    element, d = state.keys[0].element_size(), state.keys[0].shape[-1]
    for layer, entries in enumerate(built):
        for head in range(state.num_kv_heads):
            expected = {j for j in range(N - WINDOW) if float(scores[layer][head, j]) >= tau} | set(range(N - WINDOW, N))
            count = int(entries.counts[head])
            assert set(entries.positions[head, :count].tolist()) == expected
            assert counts[layer, head] == len(expected)
    assert 0.3 < counts.sum() / (state.num_layers * state.num_kv_heads * N) < 0.8
    assert np.array_equal(method.budgets(state, 160), counts)  # B plays no part
    assert kept_bytes(state, counts) == int(counts.sum()) * 2 * d * element  # the bytes are the entries kept
    described = method.describe()
    assert described["threshold"] == {"tau": tau, "protected_window": WINDOW} and method.prompt_dependent


def test_exact_budget_methods_keep_their_counts_beside_a_threshold_variant(state, weights):
    threshold = make_method(f"kvzap:weights={weights}:threshold=-100")  # every score passes: the whole prompt
    assert int(threshold.budgets(state, 40).sum()) == state.num_layers * state.num_kv_heads * N
    for spec in ("snapkv", f"kvzap:weights={weights}"):
        for budget in (40, 128):
            assert int(make_method(spec).budgets(state, budget).sum()) == state.num_layers * state.num_kv_heads * budget
    assert make_method("snapkv:threshold=0.01").label == "snapkv:threshold=0.01"


@pytest.mark.parametrize("spec, words", [
    ("snapkv:threshold=abc", "threshold must be a number"),
    ("snapkv:threshold=nan", "finite number"),
    ("pyramidkv:threshold=0.1", "allocator would change nothing"),
    ("streamingllm:threshold=0.1", "does not rank single entries"),
    ("simlayerkv:threshold=0.1", "reading=threshold"),
    ("snapkv:chunk_length=8:threshold=0.1", "does not rank single entries"),
    ("snapkv:threshold=0.1:quant=kivi", "use one or the other"),
    ("full:threshold=0.1", "does not rank single entries"),
])
def test_a_threshold_where_it_means_nothing_is_one_line(spec, words):
    with pytest.raises(UserError, match=words):
        make_method(spec)


def test_a_threshold_variant_has_no_budget_of_its_own_and_composes_with_entry_options(state):
    tau = float(make_method("snapkv").scorer.scores(state, 1).median())  # SnapKV's pooled window attention
    method = make_method(f"snapkv:threshold={tau!r}")
    with pytest.raises(UserError, match="depend on each prompt"):
        method.layer_budgets(4, 32, 200)
    assert method.decode_policy(4) is None  # evicts once after the prefill: --decode-budget total refuses it
    counts = method.budgets(state, 40)
    assert 0 < counts.sum() < state.num_layers * state.num_kv_heads * N
    for spec in (f"snapkv:threshold={tau!r}:merge=kvpress", f"snapkv:threshold={tau!r}:rerotate=1"):
        wrapped = make_method(spec)
        built = wrapped.compress(state, 40)
        assert [layer.counts.tolist() for layer in built] == counts.tolist() and "threshold" in wrapped.describe()


THRESHOLD = "snapkv:threshold=0.5"


def threshold_run(tmp_path):
    """noisy_predictions (exact methods at B=64, 128) with a threshold variant closer than all, at varying bytes
    (less than B=64's on every sample), and the run's resolved specs in config.json."""
    exact = 4 * 2 * 64 * 128
    records = []
    for line in noisy_predictions():
        if line["budget"] is not None:
            line = {**line, "kv_bytes": exact * line["budget"] // 64, "kv_budget_bytes": exact * line["budget"] // 64,
                    "kept_entries": 4 * 2 * line["budget"]}
        records.append(line)
        if line["method"] == "ahead":
            spent = exact // 2 + 256 * (int(line["id"].split("-")[1]) % 4)
            records.append({**line, "method": THRESHOLD, "kl": line["kl"] / 4, "kv_bytes": spent,
                            "kept_entries": spent // 128})
    run = write(tmp_path / "run", records)
    specs = {THRESHOLD: make_method(THRESHOLD).describe(), "snapkv": make_method("snapkv").describe()}
    (run / "config.json").write_text(json.dumps({"method_specs": specs}))
    return run, [r for r in records if r["method"] == THRESHOLD]


def test_reports_never_rank_a_threshold_variant_and_place_it_on_the_memory_axis_at_its_bytes(tmp_path):
    run, lines = threshold_run(tmp_path)
    tables = report.render(run, plots=False)
    board = pd.read_csv(run / "leaderboard.csv").set_index("method")
    row = board.loc[THRESHOLD]
    assert pd.isna(row["rank"]) and bool(row["over_budget"]) and bool(row["threshold"]) and row["kl_verdict"] == "threshold"
    assert board.loc["ahead", "rank"] == 1 and not board.loc[["snapkv", "ahead", "clone"], "threshold"].any()
    assert THRESHOLD not in set(tables["ranks"]["method"])
    headline = pd.read_csv(run / "headline.csv")
    assert THRESHOLD not in set(headline["closest"]) | set(headline["runner_up"])
    summary = (run / "summary.md").read_text()
    assert f"Threshold: `{THRESHOLD}`" in summary and f"Over budget: `{THRESHOLD}`" not in summary
    assert "| threshold |" in summary.split("## Leaderboard")[1]  # the flag column says why it is unranked
    memory = pd.read_csv(run / "memory_axis.csv")
    placed = memory[memory["method"] == THRESHOLD]
    spent = [line["kv_bytes"] for line in lines]
    assert len(placed) == 1 and pd.isna(placed["budget"].iloc[0]) and bool(placed["threshold"].iloc[0])
    assert placed["kv_bytes"].iloc[0] == pytest.approx(np.mean(spent))
    assert (placed["kv_bytes_min"].iloc[0], placed["kv_bytes_max"].iloc[0]) == (min(spent), max(spent))
    assert min(spent) < max(spent) and pd.isna(placed["kl_verdict"].iloc[0]) and pd.isna(placed["kl_ratio_vs_uniform"].iloc[0])
    exact = memory[memory["method"] == "snapkv"]
    assert list(exact["kv_bytes"]) == [4 * 2 * 64 * 128] and not exact["threshold"].any()
    text = (run / "memory_axis.md").read_text()
    matched, apart = text.split("Threshold variants:")
    assert THRESHOLD not in matched and f"| {THRESHOLD} | 30 |" in apart
    assert f"{np.mean(spent):.0f} [{min(spent)}, {max(spent)}]" in apart


def test_simlayerkvs_threshold_reading_is_flagged_whatever_it_kept(tmp_path):
    """SimLayerKV's kvpress reading once counted as over budget only on samples where it kept more than B: one
    that kept less was ranked among exact budgets. Its spec says it spends by a threshold, so it never is."""
    from ripplekv.analysis.over_budget import thresholded

    spec = "simlayerkv:reading=threshold"
    specs = {spec: make_method(spec).describe(), "simlayerkv": make_method("simlayerkv").describe(),
             "snapkv": make_method("snapkv").describe()}
    assert thresholded(specs) == {spec}


def test_a_threshold_variant_has_no_cell_in_a_factorial_design():
    """`kvzap:threshold=-5` resolves to kvzap's allocator and scorer: read as a cell it would stand beside (and be
    averaged with) the budgeted `snapkv:scorer=kvzap`, at no budget."""
    from ripplekv.methods.factors import design

    labels = ("snapkv", "snapkv:threshold=0.01", "simlayerkv:reading=threshold", "kvzap:threshold=-5")
    cells = design({label: make_method(label).describe() for label in labels})
    assert [cell[0] for cell in cells] == ["snapkv"]


@pytest.mark.slow  # a whole eval command, end to end
def test_eval_records_what_a_threshold_variant_spent_and_reports_it_apart(tiny_model_dir, tmp_path, run_cli):
    """`eval --methods snapkv,kvzap,kvzap:threshold=0` at B=32 and 64: the exact methods keep L x H_kv x B
    entries, the threshold variant the same entries at both budgets, its bytes those entries'; the leaderboard
    leaves it unranked and the memory axis has its one row at those bytes."""
    weights = tiny_weights(tmp_path, dim=32)
    threshold = f"kvzap:weights={weights.name}:threshold=0"
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "2",
                           "--target-tokens", "300", "--methods",
                           f"snapkv,kvzap:weights={weights},kvzap:weights={weights}:threshold=0",
                           "--budget", "32", "--budget", "64", "--out", str(out))
    assert code == 0, err
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    d, element, heads, layers = 8, 4, 2, 4  # tiny_model_dir: hidden 32 over 4 heads, 2 KV heads, float32
    for line in lines:
        if line["method"] in ("snapkv", f"kvzap:weights={weights.name}"):
            assert line["kept_entries"] == layers * heads * line["budget"]
    spent = {(line["id"], line["budget"]): line for line in lines if line["method"] == threshold}
    prompt = {line["id"]: line["compressed_tokens"] for line in lines if line["method"] == "full"}
    assert len(spent) == 4
    for (sample, _), line in spent.items():
        assert line["kv_bytes"] == line["kept_entries"] * 2 * d * element
        assert line["kept_entries"] == spent[(sample, 32)]["kept_entries"]  # B plays no part
        assert layers * heads * 32 < line["kept_entries"] < layers * heads * prompt[sample]
    board = pd.read_csv(out / "leaderboard.csv")
    assert board.loc[board["method"] == threshold, "rank"].isna().all()
    assert board.loc[board["method"] == "snapkv", "rank"].notna().all()
    memory = pd.read_csv(out / "memory_axis.csv")
    placed = memory[memory["method"] == threshold].iloc[0]
    kept = [line["kv_bytes"] for (_, budget), line in spent.items() if budget == 32]
    assert placed["kv_bytes"] == pytest.approx(np.mean(kept)) and placed["kv_bytes_max"] == max(kept)


def test_a_sliding_layer_keeps_only_what_it_holds_whatever_tau():
    """Gemma 2's sliding layers hold the last 16 tokens: a threshold every score passes keeps exactly each layer's
    capacity (the sliding window there, the whole prompt in global layers), as the full cache holds."""
    from tests.conftest import HYBRID_WINDOW, tiny_gemma2

    model = tiny_gemma2()
    ids = torch.randint(0, 101, (80,), generator=torch.Generator().manual_seed(1))
    method = make_method("snapkv:window=8:threshold=-1000000")
    state = prefill_for(model, ids, method.requirements())
    counts = method.budgets(state, 40)
    assert [int(c) for c in counts[:, 0]] == state.capacities and min(state.capacities) <= HYBRID_WINDOW < 80
    for layer, entries in enumerate(method.compress(state, 40)):
        assert int(entries.counts.min()) == state.capacities[layer]
        assert int(entries.positions[:, : int(entries.counts[0])].min()) == state.held_from(layer)
