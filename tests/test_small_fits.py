"""Rows read from a smoke-size learned fit (KVzap's shipped surrogate) are listed but never ranked or judged, and
rows reading a file fitted before the run say what it was fitted on."""

import json
from pathlib import Path

import pandas as pd

from ripplekv.analysis import report
from ripplekv.analysis.small_fits import MIN_FIT_PROMPTS, fitted_elsewhere_lines, small_fits
from ripplekv.methods.fit_records import fit_records

LUKV = {"preset": "lukv", "allocator": {"name": "lukv", "rounding": "exact"}, "scorer": {"name": "lukv", "window": 1}}
KVZAP = {"preset": "kvzap", "allocator": {"name": "uniform"}, "scorer": {"name": "kvzap", "window": 32, "model": "mlp"}}


def sidecar(folder: Path, name: str, prompts: int) -> str:
    """A weights path whose sidecar says it was fitted on `prompts` prompts, every 4th held out (the fitters'
    default), the weights never read here."""
    folder.mkdir(parents=True, exist_ok=True)
    held = prompts // 4
    (folder / f"{name}.json").write_text(json.dumps({"train_prompts": prompts - held, "held_out_prompts": held,
                                                     "train_pairs": 300 * (prompts - held), "target_tokens": 500}))
    return str(folder / f"{name}.safetensors")


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


def test_a_fit_below_the_bar_is_named_with_its_size_and_one_at_it_is_not(tmp_path):
    small, large = sidecar(tmp_path, "small", 4), sidecar(tmp_path, "large", MIN_FIT_PROMPTS)
    specs = {"zap-small": {"scorer": {"name": "kvzap", "model": "mlp", "weights": small}},
             "zap-large": {"scorer": {"name": "kvzap", "model": "mlp", "weights": large}},
             "gates": {"parts": [{"scorer": {"name": "fastkvzip", "weights": small}}]},  # nested in a composite
             "snapkv": {"scorer": {"name": "snapkv", "window": 32}}}
    records = fit_records(specs, bundled=False)
    assert set(records) == {"zap-small", "zap-large", "gates"} and records["zap-large"][0]["prompts"] == 16
    said = "`small.safetensors` fitted on 4 calibration prompts (3 trained on, 900 pairs)"
    assert small_fits(records) == {"zap-small": said, "gates": said}


def test_the_shipped_files_count_only_for_the_bundled_model():
    specs = {"kvzap": KVZAP, "lukv": LUKV}
    records = fit_records(specs, bundled=True)
    assert small_fits(records) == {"kvzap": "`smollm2-135m-mlp.safetensors` fitted on 4 calibration prompts "
                                            "(3 trained on, 900 pairs)"}
    curve = records["lukv"][0]  # LU-KV's shipped curve: not a learned scorer, never a small fit
    assert (curve["file_name"], curve["prompts"], curve["target_tokens"], curve["learned"]) == \
        ("smollm2-135m-lukv.csv", 8, 3500, False) and "niah" in curve["tasks"]
    assert fit_records(specs, bundled=False) == {}  # another model never reads the shipped files


def test_a_small_fit_row_is_left_out_of_ranks_verdicts_and_the_headline(tmp_path):
    run = predictions(tmp_path / "run")
    specs = {"ahead": {"scorer": {"name": "kvzap", "model": "mlp", "weights": sidecar(tmp_path, "zap", 4)}},
             "snapkv": {"scorer": {"name": "snapkv"}}, "clone": {"scorer": {"name": "snapkv"}}}
    tables = report.render(run, plots=False, html=False, fits=fit_records(specs, bundled=False))
    board = pd.read_csv(run / "leaderboard.csv").set_index("method")
    assert bool(board.loc["ahead", "small_fit"]) and not board.loc[["snapkv", "clone", "coin"], "small_fit"].any()
    assert pd.isna(board.loc["ahead", "rank"]) and board.loc["coin", "rank"] == 1  # ahead beat every row
    assert board.loc["ahead", "kl_verdict"] == "small fit" and board.loc["ahead", "verdict"] == "small fit"
    assert "ahead" not in set(tables["ranks"]["method"])
    headline = pd.read_csv(run / "headline.csv")
    assert "ahead" not in set(headline["closest"]) | set(headline["runner_up"])
    summary = (run / "summary.md").read_text()
    assert "Small fit: `ahead`: `zap.safetensors` fitted on 4 calibration prompts (3 trained on, 900 pairs)." in summary
    assert "| rank | small fit |" in summary
    assert fitted_elsewhere_lines(run) == []  # a file given by option was not fitted before the run


def test_the_results_page_names_the_rows_reading_shipped_files(tmp_path):
    run = predictions(tmp_path / "run")
    report.render(run, plots=False, html=False, fits=fit_records({"lukv": LUKV, "kvzap": KVZAP}, bundled=True))
    line = fitted_elsewhere_lines(run)[1]
    assert line.startswith("**Fitted before this run.**")
    assert "`lukv` reads `smollm2-135m-lukv.csv`, fitted on 8 calibration prompts of 3500 tokens (" in line
    assert "`kvzap` reads `smollm2-135m-mlp.safetensors`, fitted on 4 calibration prompts of 500 tokens" in line
