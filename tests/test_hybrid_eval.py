"""`ripplekv profile`, `allocate` and `eval` end to end on tiny random Gemma 2 and Gemma 3 models (sliding-window
layers beside global ones), as a user runs them on Gemma 3 270M: RippleKV after its own profile and allocation,
SnapKV and PyramidKV, each keeping exactly its budget as fitted to what each layer holds (docs/methods.md,
"Hybrid attention"): `min(L x H_kv x B, H_kv x sum of capacities)` entries, per layer what its allocator gives it
capped at the layer's capacity, and the full cache counted as what the model itself holds."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ripplekv.engine.adapter import layer_capacities, layer_windows
from ripplekv.methods import make_method
from tests.conftest import invoke, tiny_gemma2, tiny_gemma3

pytestmark = pytest.mark.slow  # whole commands run end to end

TARGET_TOKENS = 256  # prompts far past a sliding layer's window
WINDOW = 48  # above the methods' observation window (32), so the budgets below it are scored, not recency
# At 40 no cap binds but RippleKV's larger shares (and every method is scored); at 80 a sliding layer keeps its whole
# window and the global layers take the rest; at 300 all layers together hold less than L x B, so every method keeps
# all the model holds.
BUDGETS = (40, 80, 300)
METHODS = ("full", "snapkv", "pyramidkv", "ripplekv")
BUILDERS = {"gemma3": tiny_gemma3, "gemma2": tiny_gemma2}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def hybrid_run(request, tmp_path_factory, tokenizer):
    """A tiny hybrid model with the real tokenizer's vocabulary, profiled, allocated and evaluated: (config, folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = BUILDERS[request.param](vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                    sliding_window=WINDOW)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    common = ("--model", folder / "model", "--target-tokens", TARGET_TOKENS)
    profiled = invoke("profile", *common, "--calib-samples", 2, "--seeds", 1, "--eta", 1.0, "--probe-tokens", 8,
                      "--out", folder / "profile")
    assert profiled.returncode == 0, profiled.stderr
    allocated = invoke("allocate", folder / "profile" / "sensitivity.csv", "--model", folder / "model", "--ratio", 4,
                       "--out", folder / "alloc.csv")
    assert allocated.returncode == 0, allocated.stderr
    budgets = [arg for budget in BUDGETS for arg in ("--budget", budget)]
    evaluated = invoke("eval", *common, "--suite", "offline", "--tasks", "niah", "--limit", 1, *budgets,
                       "--methods", ",".join(METHODS), "--allocation", folder / "alloc.csv", "--batch-size", 10,
                       "--out", folder / "eval")
    assert evaluated.returncode == 0, evaluated.stderr
    return model.config, folder


def test_the_profile_sees_every_layer_and_the_allocation_spreads_them(hybrid_run):
    config, folder = hybrid_run
    layers = config.num_hidden_layers
    sensitivity = pd.read_csv(folder / "profile" / "sensitivity.csv")
    assert list(sensitivity["layer"]) == list(range(layers)) and (sensitivity["kl_mean"] > 0).all()
    allocation = pd.read_csv(folder / "alloc.csv")
    assert len(allocation) == layers and allocation["multiplier"].mean() == pytest.approx(1.0)
    assert allocation["multiplier"].max() / allocation["multiplier"].min() == pytest.approx(4.0)


def test_every_method_keeps_exactly_its_budget_fitted_to_each_layers_capacity(hybrid_run):
    config, folder = hybrid_run
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    windows = layer_windows(config)
    assert set(windows) == {WINDOW, None}  # sliding and global layers both present
    multipliers = tuple(pd.read_csv(folder / "alloc.csv")["multiplier"])
    expected_methods = {"snapkv": make_method("snapkv"), "pyramidkv": make_method("pyramidkv"),
                        "ripplekv": make_method("ripplekv", multipliers=multipliers)}
    rows = [json.loads(line) for line in (folder / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 1 + (len(METHODS) - 1) * len(BUDGETS)
    for row in rows:
        caps = layer_capacities(row["compressed_tokens"], windows)
        assert max(caps) > WINDOW and min(caps) == WINDOW - 1  # the prompt outgrew the window
        if row["method"] == "full":
            assert row["kept_entries"] == heads * sum(caps) and row["layer_budgets"] == caps and row["kl"] == 0
            continue
        budget = row["budget"]
        assert row["kept_entries"] == min(layers * heads * budget, heads * sum(caps)), (row["method"], budget)
        assert row["layer_budgets"] == expected_methods[row["method"]].layer_budgets(layers, budget, caps)
        assert all(kept <= cap for kept, cap in zip(row["layer_budgets"], caps)) and row["kl"] >= 0
    by_method = {(r["method"], r["budget"]): r["layer_budgets"] for r in rows}
    # The profile's allocation moves entries between layers; at 300 every method holds all the model holds.
    assert by_method[("ripplekv", 40)] != by_method[("snapkv", 40)]
    assert by_method[("ripplekv", 300)] == by_method[("snapkv", 300)] == by_method[("full", None)]
    # At 80 SnapKV's sliding layers keep their whole window and its global layers share what they could not hold.
    assert all(kept == (WINDOW - 1 if window else kept) for kept, window in zip(by_method[("snapkv", 80)], windows))
    assert min(kept for kept, window in zip(by_method[("snapkv", 80)], windows) if window is None) > 80
