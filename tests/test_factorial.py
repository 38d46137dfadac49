"""The study's factorial core: cells read from resolved specs, contrasts that recover known effects."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis import factorial
from ripplekv.methods import factors
from ripplekv.methods.core.catalog import build_methods

SHIPPED = Path(__file__).resolve().parent.parent / "src" / "ripplekv" / "data" / "allocations" / "smollm2-135m.csv"
ALLOCATIONS = {"uniform": 0.0, "ripplekv": -0.10, "lukv": -0.25}
SCORERS = {"snapkv": 0.0, "expected-attention": 0.05}
SPLITS = {"even": 0.0, "adakv": -0.08}
BOTH = -0.04  # expected-attention with adakv: an interaction


def test_cells_come_from_the_resolved_specs_not_the_labels():
    specs = ["snapkv", "expected-attention:split=adakv", "pyramidkv:scorer=expected-attention", "ripplekv:split=adakv",
             "lukv:scorer=snapkv", "lukv:scorer=snapkv:split=even", "kivi:bits=4"]
    methods = build_methods(specs, {"allocation": str(SHIPPED)}, [])
    cells = cells_of({label: m.describe() for label, m in methods.items()}).set_index("method")
    assert cells.loc["snapkv"].tolist() == ["uniform", "snapkv", "even"]
    assert cells.loc["expected-attention:split=adakv"].tolist() == ["uniform", "expected-attention", "adakv"]
    assert cells.loc["pyramidkv:scorer=expected-attention"].tolist() == ["pyramidkv", "expected-attention", "even"]
    assert cells.loc["ripplekv:split=adakv"].tolist() == ["ripplekv", "snapkv", "adakv"]
    assert cells.loc["lukv:scorer=snapkv"].tolist() == ["lukv", "snapkv", "curve"]
    assert cells.loc["lukv:scorer=snapkv:split=even"].tolist() == ["lukv", "snapkv", "even"]
    assert "kivi:bits=4" not in cells.index and "full" not in cells.index


def cells_of(method_specs: dict) -> pd.DataFrame:
    return pd.DataFrame(factors.design(method_specs), columns=["method", *factorial.FACTORS])


def synthetic_run(samples: int = 12, noise: float = 0.01):
    """KL = a sample's base + allocation + scorer + split (+ BOTH for expected-attention with adakv) + noise, at
    two budgets, on two tasks; LU-KV's own split (curve) as an extra variant outside the grid."""
    rng = np.random.default_rng(3)
    cells = list(itertools.product(ALLOCATIONS, SCORERS, SPLITS)) + [("lukv", "snapkv", "curve")]
    specs = {}
    for allocation, scorer, split in cells:  # a file allocation is named by its label's first part
        name = {"uniform": "uniform", "ripplekv": "file", "lukv": "lukv"}[allocation]
        specs[f"{allocation}:{scorer}:{split}"] = {
            "allocator": {"name": name, **({} if split == "curve" else {"split": split})}, "scorer": {"name": scorer}}
    lines = []
    for budget in (64, 128):
        for task in ("a", "b"):
            for i in range(samples):
                base = rng.uniform(0.5, 1.0)
                for allocation, scorer, split in cells:
                    effect = ALLOCATIONS[allocation] + SCORERS[scorer] + SPLITS.get(split, 0.0)
                    effect += BOTH if (scorer, split) == ("expected-attention", "adakv") else 0.0
                    lines.append({"task": task, "id": f"{task}{i}", "budget": budget,
                                  "method": f"{allocation}:{scorer}:{split}",
                                  "kl": base + effect + rng.normal(0, noise)})
    return pd.DataFrame(lines), cells_of(specs)


def test_effects_recover_the_main_effects_the_interaction_and_the_pair():
    frame, cells = synthetic_run()
    table = factorial.effects(frame, cells, pair=("ripplekv", "lukv"), reference=factors.REFERENCE_ALLOCATION).set_index(["budget", "effect"])
    row = table.loc[64]
    # main effects average over the other factors' cells, the interaction included: half of BOTH on each
    assert row.loc["scorer: expected-attention - snapkv", "delta"] == pytest.approx(0.05 + BOTH / 2, abs=0.01)
    assert row.loc["split: adakv - even", "delta"] == pytest.approx(-0.08 + BOTH / 2, abs=0.01)
    assert row.loc["allocation: lukv - uniform", "delta"] == pytest.approx(-0.25, abs=0.01)
    assert row.loc["allocation: ripplekv - uniform", "delta"] == pytest.approx(-0.10, abs=0.01)
    interaction = row.loc["scorer x split: (expected-attention - snapkv) at adakv minus at even"]
    assert interaction["delta"] == pytest.approx(BOTH, abs=0.01) and interaction["kind"] == "interaction"
    assert row.loc["lukv - ripplekv", "delta"] == pytest.approx(-0.15, abs=0.01)
    assert row.loc["lukv - ripplekv at snapkv, even", "cells"] == 2
    assert row.loc["(lukv - ripplekv) at split adakv minus at even", "delta"] == pytest.approx(0.0, abs=0.01)
    # LU-KV's own per-head split is not part of the grid
    assert not any("curve" in name for name in row.index)
    assert (row["samples"] == 24).all()
    # every clear effect is called, the null pair interaction is not
    assert row.loc["allocation: lukv - uniform", "verdict"] == "closer"
    assert row.loc["(lukv - ripplekv) at split adakv minus at even", "verdict"] in ("tied", "underpowered")
    # one Holm family per budget: the adjusted p-values are Holm's of that budget's raw ones
    from ripplekv.analysis.inference import holm

    assert np.allclose(row["p_holm"].to_numpy(), holm(row["p"].to_numpy()))


def test_a_contrast_is_the_mean_over_samples_of_its_per_sample_cell_differences():
    """Independent of the weights: the scorer effect by plain pandas means over the grid's cells."""
    frame, cells = synthetic_run(samples=6, noise=0.05)
    at = frame[frame["budget"] == 128]
    wide = at.pivot_table(index=["task", "id"], columns="method", values="kl")
    ea = wide[[c for c in wide if ":expected-attention:" in c and not c.endswith("curve")]].mean(axis=1)
    snap = wide[[c for c in wide if ":snapkv:" in c and not c.endswith("curve")]].mean(axis=1)
    by_task = (ea - snap).groupby(level="task").mean().mean()
    table = factorial.effects(frame, cells).set_index(["budget", "effect"])
    assert table.loc[(128, "scorer: expected-attention - snapkv"), "delta"] == pytest.approx(by_task, abs=1e-12)


def test_a_tied_effect_whose_detectable_size_is_above_the_meaningful_one_reads_underpowered():
    frame, cells = synthetic_run(samples=3, noise=0.3)
    table = factorial.effects(frame, cells, meaningful=0.01)
    assert "underpowered" in set(table["verdict"]) and "tied" not in set(table["verdict"])
    markdown = factorial.effects_markdown(table)
    assert "### B=64" in markdown and "| scorer: expected-attention - snapkv | main |" in markdown


def test_the_verdict_paragraph_names_the_row_each_sentence_rests_on():
    from ripplekv.analysis import study_page

    frame, cells = synthetic_run()
    effects = study_page.with_ids(factorial.effects(frame, cells, pair=("ripplekv", "lukv"), reference="uniform"))
    assert effects.groupby("budget")["id"].first().tolist() == ["F-64-1", "F-128-1"]
    rows = study_page.primary(effects, "lukv - ripplekv", meaningful={64: 0.05, 128: 0.05})
    assert rows["id"].tolist() == ["P-64", "P-128"] and (rows["verdict"] == "closer").all()
    from ripplekv.analysis.inference import holm

    assert np.allclose(rows["p_holm"], holm(rows["p"].to_numpy()))
    text = study_page.verdict_paragraph(rows, effects)
    first = rows.iloc[0]
    assert (f"At B=64, lukv is closer to the full cache than ripplekv: KL difference {first['delta']:+.3f} "
            f"[{first['ci_low']:+.3f}, {first['ci_high']:+.3f}]") in text and "(P-64)" in text
    # the largest main effect called at each budget: LU-KV's allocation against uniform, with its row id
    lukv_row = effects[(effects["budget"] == 64) & (effects["effect"] == "allocation: lukv - uniform")].iloc[0]
    assert f"largest allocation effect called is lukv against uniform: {lukv_row['delta']:+.3f}" in text
    assert f"({lukv_row['id']})" in text
    assert "| P-64 | 64 | lukv - ripplekv |" in study_page.primary_markdown(rows)
    # the question's own effect, and a called difference under the meaningful size said so
    focused = study_page.verdict_paragraph(rows, effects, meaningful=10.0, focus="allocation: lukv - uniform")
    assert (f"Averaged over scorers and head splits at B=64, lukv is closer to the full cache than uniform: "
            f"{lukv_row['delta']:+.3f}") in focused and "smaller than the meaningful 10, Holm p" in focused
    assert "smaller than the meaningful" not in text
    assert "| F-64-1 | scorer: expected-attention - snapkv | main |" in study_page.factorial_markdown(effects)


def test_the_verdict_says_what_the_second_models_leaderboard_says():
    from ripplekv.analysis import study_page

    board = pd.DataFrame({
        "method": ["full", "snapkv", "ripplekv:allocation=a.csv", "snapkv", "ripplekv:allocation=a.csv"],
        "budget": [None, 128, 128, 256, 256], "n": [90] * 5, "versus": [None, None, "snapkv", None, "snapkv"],
        "kl_delta_vs_uniform": [None, None, -0.031, None, -0.008], "kl_delta_ci_low": [None, None, -0.05, None, -0.012],
        "kl_delta_ci_high": [None, None, -0.012, None, -0.004], "p_kl_vs_uniform_holm": [None, None, 0.004, None, 0.02],
        "kl_verdict": [None, None, "closer", None, "closer"]})
    said = study_page.second_model_sentences(board, "gemma3-270m", "ripplekv", meaningful=0.01)
    assert said == [
        "On the second model (`gemma3-270m`) at B=128, ripplekv is closer to the full cache than snapkv: KL difference "
        "-0.031 [-0.050, -0.012], Holm p 0.004, n = 90 (its leaderboard).",
        "On the second model (`gemma3-270m`) at B=256, ripplekv is closer to the full cache than snapkv: KL difference "
        "-0.008 [-0.012, -0.004], smaller than the meaningful 0.01, Holm p 0.02, n = 90 (its leaderboard)."]
    frame, cells = synthetic_run()
    effects = study_page.with_ids(factorial.effects(frame, cells, pair=("ripplekv", "lukv"), reference="uniform"))
    rows = study_page.primary(effects, "lukv - ripplekv", meaningful={64: 0.05, 128: 0.05})
    assert study_page.verdict_paragraph(rows, effects, more=said).rstrip().endswith(said[-1])
