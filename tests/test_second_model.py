"""The results page's second-model section: its leaderboard, and a ranking that holds only where both models
decide (a tie on either model is undecided, never agreement or reversal)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis.second_model import ranking_across, second_model_lines

SAMPLES = 12


def write_eval(folder: Path, kl_of: dict[str, float], noise: float, seed: int) -> Path:
    """An eval folder whose methods' per-sample KL are `kl_of[m]` plus noise (shared by the methods on a sample)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    lines = []
    for sample in range(SAMPLES):
        shared = rng.normal(0, 0.05)
        lines.append({"id": f"s{sample}", "task": "niah", "category": "Synthetic", "method": "full", "budget": None,
                      "score": 1.0, "kl": 0.0, "agreement": 1.0})
        for method, kl in kl_of.items():
            lines.append({"id": f"s{sample}", "task": "niah", "category": "Synthetic", "method": method, "budget": 128,
                          "score": 0.5, "kl": kl + shared + rng.normal(0, noise), "agreement": 0.9})
    (folder / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_an_order_holds_reverses_or_stays_undecided(tmp_path):
    first = write_eval(tmp_path / "first", {"snapkv": 0.5, "pyramidkv": 0.8, "streamingllm": 0.65}, 0.01, 0)
    second = write_eval(tmp_path / "second", {"snapkv": 0.5, "pyramidkv": 0.2, "streamingllm": 0.5}, 0.01, 1)
    table = ranking_across(first, second, ("one", "two")).set_index("pair")
    assert table.loc["pyramidkv vs snapkv", "order"] == "reversed"
    assert table.loc["pyramidkv vs streamingllm", "order"] == "reversed"
    assert table.loc["snapkv vs streamingllm", "order"] == "undecided (tied on two)"  # equal on the second model
    assert "closer" in table.loc["snapkv vs streamingllm", "one: KL difference [95% CI]"]
    assert list(table.columns) == ["budget", "one: n", "one: KL difference [95% CI]", "two: n",
                                   "two: KL difference [95% CI]", "order"]
    assert (table["one: n"] == SAMPLES).all() and (table["two: n"] == SAMPLES).all()
    same = ranking_across(first, first, ("one", "again")).set_index("pair")
    assert (same["order"] == "holds").all() and (table["budget"] == 128).all()


def test_the_section_shows_the_leaderboard_and_the_ranking(tmp_path):
    write_eval(tmp_path / "eval", {"snapkv": 0.5, "ripplekv": 0.3}, 0.01, 2)
    gemma = write_eval(tmp_path / "gemma3" / "eval", {"snapkv": 0.4, "ripplekv": 0.1}, 0.01, 3)
    assert second_model_lines(tmp_path / "missing") == []
    (gemma / "config.json").write_text(json.dumps({"model": "gemma3-270m", "samples": {"niah": list(range(SAMPLES))}}))
    pd.DataFrame({"method": ["full", "snapkv", "ripplekv"], "budget": [None, 128, 128], "kl": [0, 0.4, 0.1],
                  "kl_ci_low": [0, 0.35, 0.05], "kl_ci_high": [0, 0.45, 0.15], "agreement": [1, 0.9, 0.95],
                  "kl_delta_vs_uniform": [None, None, -0.3], "kl_delta_ci_low": [None, None, -0.32],
                  "kl_delta_ci_high": [None, None, -0.28], "p_kl_vs_uniform_holm": [None, None, 0.001],
                  "kl_verdict": [None, "baseline", "closer"]}).to_csv(gemma / "leaderboard.csv", index=False)
    text = "\n".join(second_model_lines(tmp_path, "gemma3", "smollm2-135m"))
    assert "## Second model: `gemma3-270m`" in text and "12 samples (niah)" in text
    row = next(line for line in text.splitlines() if line.startswith("| ripplekv "))
    assert [cell.strip() for cell in row.strip("|").split("|")] == [
        "ripplekv", "128", "0.100 [0.050, 0.150]", "0.950", "-0.300 [-0.320, -0.280], 0.001 closer"]
    assert "| baseline " in text  # the uniform baseline is named, not left blank
    assert "1 holds." in text and "smollm2-135m: KL difference [95% CI]" in text


def test_the_second_models_leaderboard_shows_n_and_lists_short_rows_apart():
    from ripplekv.analysis.second_model import leaderboard_markdown

    board = pd.DataFrame({"method": ["full", "snapkv", "ripplekv"], "budget": [None, 128, 128], "n": [12, 12, 3],
                          "fewer_samples": [False, False, True], "kl": [0.0, 0.4, 0.1]})
    ranked, apart = leaderboard_markdown(board).split("Rows with fewer samples than the table's n (not ranked):")
    assert "| snapkv   | 128 | 12  |" in ranked and "ripplekv" not in ranked
    assert "| ripplekv | 128 | 3   |" in apart
