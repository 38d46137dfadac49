"""Rows read from a smoke-size learned fit (KVzap's shipped surrogate) are listed but never ranked or judged."""

import json
from pathlib import Path

import pandas as pd

from ripplekv.analysis import report
from ripplekv.analysis.small_fits import MIN_FIT_PROMPTS, small_fits


def predictions(folder: Path) -> Path:
    """A run of 2 tasks x 10 samples: `ahead` is closest to the full cache on every sample, `coin` next."""
    lines = []
    for task, category in (("squad", "Single-Doc QA"), ("passage_count", "Synthetic")):
        for i in range(10):
            base = ((7 * i) % 10) / 10
            for method, budget, score in (("full", None, 1.0), ("snapkv", 64, base), ("clone", 64, base),
                                          ("ahead", 64, min(1.0, base + 0.2)), ("coin", 64, min(1.0, base + 0.1))):
                lines.append({"id": f"{task}-{i}", "task": task, "category": category, "method": method,
                              "budget": budget, "score": score, "kl": 0.0 if budget is None else (1.2 - score) / 2,
                              "agreement": 0.9, "prompt_tokens": 300 + i, "length": 200 + i,
                              "layer_budgets": [budget or 300 + i] * 4})
    folder.mkdir(parents=True)
    (folder / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def sidecar(folder: Path, name: str, prompts: int) -> str:
    """A weights path whose sidecar says it was fitted on `prompts` prompts, every 4th held out (the fitters'
    default), the weights never read here."""
    folder.mkdir(parents=True, exist_ok=True)
    held = prompts // 4
    (folder / f"{name}.json").write_text(json.dumps({"train_prompts": prompts - held, "held_out_prompts": held,
                                                     "train_pairs": 300 * (prompts - held)}))
    return str(folder / f"{name}.safetensors")


def test_a_fit_below_the_bar_is_named_with_its_size_and_one_at_it_is_not(tmp_path):
    small, large = sidecar(tmp_path, "small", 4), sidecar(tmp_path, "large", MIN_FIT_PROMPTS)
    specs = {"zap-small": {"scorer": {"name": "kvzap", "model": "mlp", "weights": small}},
             "zap-large": {"scorer": {"name": "kvzap", "model": "mlp", "weights": large}},
             "gates": {"parts": [{"scorer": {"name": "fastkvzip", "weights": small}}]},  # nested in a composite
             "snapkv": {"scorer": {"name": "snapkv", "window": 32}}}
    assert small_fits(specs, bundled=False) == {"zap-small": "kvzap fitted on 4 calibration prompts (3 trained on, 900 pairs)",
                                                "gates": "fastkvzip fitted on 4 calibration prompts (3 trained on, 900 pairs)"}


def test_the_shipped_surrogate_counts_only_for_the_bundled_model():
    specs = {"kvzap": {"scorer": {"name": "kvzap", "model": "mlp", "window": 32}}}
    assert small_fits(specs, bundled=True) == {"kvzap": "kvzap fitted on 4 calibration prompts (3 trained on, 900 pairs)"}
    assert small_fits(specs, bundled=False) == {}  # another model never reads the shipped file


def test_a_small_fit_row_is_left_out_of_ranks_verdicts_and_the_headline(tmp_path):
    run = predictions(tmp_path / "run")
    specs = {"ahead": {"scorer": {"name": "kvzap", "model": "mlp", "weights": sidecar(tmp_path, "zap", 4)}},
             "snapkv": {"scorer": {"name": "snapkv"}}, "clone": {"scorer": {"name": "snapkv"}}}
    (run / "config.json").write_text(json.dumps({"model": None, "method_specs": specs}))
    tables = report.render(run, plots=False, html=False)
    board = pd.read_csv(run / "leaderboard.csv").set_index("method")
    assert bool(board.loc["ahead", "small_fit"]) and not board.loc[["snapkv", "clone", "coin"], "small_fit"].any()
    assert pd.isna(board.loc["ahead", "rank"]) and board.loc["coin", "rank"] == 1  # ahead beat every row
    assert board.loc["ahead", "kl_verdict"] == "small fit" and board.loc["ahead", "verdict"] == "small fit"
    assert "ahead" not in set(tables["ranks"]["method"])
    headline = pd.read_csv(run / "headline.csv")
    assert "ahead" not in set(headline["closest"]) | set(headline["runner_up"])
    summary = (run / "summary.md").read_text()
    assert "Small fit: `ahead`: kvzap fitted on 4 calibration prompts (3 trained on, 900 pairs)." in summary
    assert "| rank | small fit |" in summary
