"""`ripplekv score`: CSVs for good input; one `error:` line and exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


GOOD = [
    {"dataset": "narrativeqa", "pred": "Max Carl", "answers": ["Max Carl"], "all_classes": None},
    {"dataset": "narrativeqa", "pred": "Max", "answers": ["Max Carl"], "all_classes": None},
    {"dataset": "trec_e", "pred": "Speed\nColor", "answers": ["Speed"], "all_classes": ["Speed", "Color"], "length": 1200},
    {"dataset": "trec_e", "pred": "Color", "answers": ["Speed"], "all_classes": ["Speed", "Color"], "length": 9000},
    {"dataset": "niah_multikey", "pred": "k1 and k3", "answers": ["k1", "k2", "k3"], "all_classes": None},
]


def test_score_writes_dataset_and_sample_csvs(tmp_path, run_cli):
    pred = _write(tmp_path / "pred.jsonl", GOOD)
    code, out, err = run_cli(
        "score", str(pred), "--out", str(tmp_path / "d" / "datasets.csv"), "--samples", str(tmp_path / "s.csv")
    )
    assert code == 0, err
    datasets = pd.read_csv(tmp_path / "d" / "datasets.csv")
    assert list(datasets.columns) == ["dataset", "n", "score", "metric"]
    assert datasets.to_dict("records") == [
        {"dataset": "narrativeqa", "n": 2, "score": 83.33, "metric": "qa_f1"},
        {"dataset": "trec_e", "n": 2, "score": 50.0, "metric": "classification"},
        {"dataset": "trec_e@0-4k", "n": 1, "score": 100.0, "metric": "classification"},
        {"dataset": "trec_e@8k+", "n": 1, "score": 0.0, "metric": "classification"},  # empty 4-8k bucket: no row
        {"dataset": "niah_multikey", "n": 1, "score": 66.67, "metric": "string_match"},
    ]
    samples = pd.read_csv(tmp_path / "s.csv")
    assert list(samples.columns) == ["line", "dataset", "score"]
    assert samples["line"].tolist() == [0, 1, 2, 3, 4]
    assert samples["score"].tolist() == [100.0, 66.67, 100.0, 0.0, 66.67]
    assert "trec_e@0-4k" in out and "83.33" in out


def test_without_out_score_writes_where_every_command_does_and_says_so(tmp_path, monkeypatch, run_cli):
    """--out is optional on every command: a default under runs/, named on stderr."""
    pred = _write(tmp_path / "pred.jsonl", GOOD)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("score", str(pred))
    assert code == 0, err
    assert err.splitlines()[0] == "score: writing to runs/score/scores.csv (the default; choose with --out)"
    given = tmp_path / "given.csv"
    assert run_cli("score", str(pred), "--out", str(given))[0] == 0
    assert (tmp_path / "runs" / "score" / "scores.csv").read_bytes() == given.read_bytes()


SUMMARIES = [
    {"dataset": "gov_report", "pred": "the cats were running", "answers": ["The cat was run"], "all_classes": None},
    {"dataset": "narrativeqa", "pred": "Max", "answers": ["Max Carl"], "all_classes": None},
]


@pytest.mark.parametrize("rouge, gov_report, metric", [(None, 0.0, "rouge"), ("rouge-score", 75.0, "rouge:rouge-score")])
def test_rouge_option_rescores_summaries_and_says_so(tmp_path, run_cli, rouge, gov_report, metric):
    pred = _write(tmp_path / "pred.jsonl", SUMMARIES)
    code, out, err = run_cli("score", str(pred), "--out", str(tmp_path / "d.csv"), *(["--rouge", rouge] if rouge else []))
    assert code == 0, err
    datasets = pd.read_csv(tmp_path / "d.csv").set_index("dataset")
    assert datasets.loc["gov_report", "score"] == gov_report and datasets.loc["gov_report", "metric"] == metric
    assert datasets.loc["narrativeqa", "score"] == 66.67 and datasets.loc["narrativeqa", "metric"] == "qa_f1"
    assert metric in out


def test_unknown_rouge_is_one_line(tmp_path, run_cli):
    pred = _write(tmp_path / "pred.jsonl", SUMMARIES)
    code, _, err = run_cli("score", str(pred), "--out", str(tmp_path / "d.csv"), "--rouge", "rouge2")
    assert code == 2 and err == "error: Invalid value for '--rouge': 'rouge2' is not one of 'official', 'rouge-score'.\n"
    assert not (tmp_path / "d.csv").exists()


def test_sample_line_numbers_count_blank_lines(tmp_path, run_cli):
    pred = _write(tmp_path / "pred.jsonl", [GOOD[0], "", GOOD[1]])
    code, _, err = run_cli("score", str(pred), "--out", str(tmp_path / "d.csv"), "--samples", str(tmp_path / "s.csv"))
    assert code == 0, err
    assert pd.read_csv(tmp_path / "s.csv")["line"].tolist() == [0, 2]


@pytest.mark.parametrize(
    "records, message",
    [
        ([GOOD[0], '{"dataset": "narrativeqa", "pred": '], "line 2: not valid JSON"),
        ([{"dataset": "narrativeqa", "pred": "x"}], "line 1: 'answers' missing or not a list"),
        ([{"dataset": "narrativeqa", "pred": "x", "answers": "x"}], "line 1: 'answers' missing or not a list"),
        ([{"dataset": "nope", "pred": "x", "answers": ["x"]}], "line 1: unknown dataset 'nope'; known: 2wikimqa"),
        ([{"dataset": "trec_e", "pred": "x", "answers": ["x"], "all_classes": ["x"]}], "needs a numeric 'length'"),
        ([{"dataset": "trec", "pred": "x", "answers": ["x"], "all_classes": None}], "line 1: classification needs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, records, message, run_cli):
    pred = _write(tmp_path / "pred.jsonl", records)
    code, _, err = run_cli("score", str(pred), "--out", str(tmp_path / "d.csv"))
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "d.csv").exists()


def test_missing_file(tmp_path, run_cli):
    code, _, err = run_cli("score", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path / "d.csv"))
    assert code == 2
    assert err == f"error: predictions file not found: {tmp_path / 'absent.jsonl'}\n"


def test_installed_command_exit_code(tmp_path):
    exe = Path(sys.executable).with_name("ripplekv")
    if not exe.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    pred = _write(tmp_path / "pred.jsonl", ["{not json"])
    proc = subprocess.run(
        [str(exe), "score", str(pred), "--out", str(tmp_path / "d.csv")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr == f"error: {pred} line 1: not valid JSON (Expecting property name enclosed in double quotes)\n"


def test_a_predictions_file_with_a_utf8_bom_scores_as_without(tmp_path, run_cli):
    plain, marked = _write(tmp_path / "plain.jsonl", GOOD), tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    for source, out in ((plain, "a.csv"), (marked, "b.csv")):
        code, _, err = run_cli("score", str(source), "--out", str(tmp_path / out))
        assert code == 0, err
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()
