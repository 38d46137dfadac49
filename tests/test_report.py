"""`ripplekv report` from a hand-made predictions file: task scores, averages, ranks, plots, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from ripplekv import report

# task -> category; two categories so category averages differ from the overall average.
TASKS = {"niah": "Synthetic", "passage_count": "Synthetic", "squad": "Single-Doc QA"}
# (method, budget) -> score of every sample of every task except squad, which scores `squad`.
PLAN = {
    ("full", None): (1.0, 1.0),
    ("snapkv", 64): (1.0, 0.5),
    ("streamingllm", 64): (0.5, 0.5),
    ("pyramidkv", 64): (1.0, 0.5),  # ties with snapkv at 64
    ("snapkv", 128): (1.0, 1.0),
    ("streamingllm", 128): (0.5, 0.0),
    ("pyramidkv", 128): (0.0, 0.5),
}


def predictions(samples_per_task: int = 2) -> list[dict]:
    out = []
    for task, category in TASKS.items():
        for i in range(samples_per_task):
            for (method, budget), (score, squad) in PLAN.items():
                n = 300 + 100 * i
                out.append({
                    "id": f"{task}-{i}", "task": task, "category": category, "method": method, "budget": budget,
                    "prediction": "x", "answers": ["x"], "score": squad if task == "squad" else score,
                    "kept_entries": 8 * (budget or n), "kl": 0.0 if method == "full" else 1.0 / budget,
                    "agreement": 1.0 if method == "full" else 0.5, "prompt_tokens": n,
                    "layer_budgets": [n] * 4 if budget is None else [budget] * 4,
                })
    return out


def write(folder: Path, records: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (folder / "predictions.jsonl").write_text(text, encoding="utf-8")
    return folder


def test_task_scores_are_longbench_rounded_means(tmp_path):
    tables = report.render(write(tmp_path / "run", predictions()))
    scores = pd.read_csv(tmp_path / "run" / "scores.csv")
    assert list(scores.columns) == ["task", "category", "method", "budget", "n", "score", "kl", "agreement"]
    assert len(scores) == len(TASKS) * len(PLAN) and (scores["n"] == 2).all()
    row = scores[(scores.task == "squad") & (scores.method == "snapkv") & (scores.budget == 64)].iloc[0]
    assert row.score == 50.0 and row.kl == pytest.approx(1 / 64) and row.agreement == 0.5
    assert scores.loc[scores.method == "full", "budget"].isna().all()
    assert tables["scores"]["budget"].dtype == "Int64"


def test_leaderboard_averages_over_tasks_and_ranks_within_each_budget(tmp_path):
    board = report.render(write(tmp_path / "run", predictions()))["leaderboard"]
    first = board.iloc[0]
    assert first["method"] == "full" and pd.isna(first["rank"]) and pd.isna(first["budget"])
    at64 = board[board["budget"] == 64].set_index("method")
    assert at64.loc["snapkv", "avg"] == round((100 + 100 + 50) / 3, 2)
    assert at64.loc["snapkv", "Synthetic"] == 100.0 and at64.loc["snapkv", "Single-Doc QA"] == 50.0
    assert at64.loc["snapkv", "rank"] == 1 and at64.loc["pyramidkv", "rank"] == 1  # ties share the better rank
    assert at64.loc["streamingllm", "rank"] == 3
    at128 = board[board["budget"] == 128]
    assert list(at128["method"]) == ["snapkv", "streamingllm", "pyramidkv"]  # best first
    assert list(at128["rank"]) == [1, 2, 3]
    assert board["budget"].dropna().is_monotonic_increasing


def test_wide_table_has_one_column_per_task_grouped_by_category(tmp_path):
    report.render(write(tmp_path / "run", predictions()))
    wide = pd.read_csv(tmp_path / "run" / "leaderboard_wide.csv")
    assert list(wide.columns) == ["method", "budget", "niah", "passage_count", "squad", "avg"]
    board = pd.read_csv(tmp_path / "run" / "leaderboard.csv")
    assert list(wide["avg"]) == list(board["avg"])


def test_report_writes_plots_and_summary_and_ignores_a_partial_last_line(tmp_path, run_cli):
    run = write(tmp_path / "run", predictions(), tail='{"id": "niah-9", "task": "ni')
    code, out, err = run_cli("report", str(run))
    assert code == 0, err
    for name in ("score_vs_budget.png", "kl_vs_budget.png", "layer_budgets.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG"
    summary = (run / "summary.md").read_text()
    assert "| method | budget | rank | avg |" in summary and "6 samples over 3 tasks" in summary
    assert "B=64" in out and "streamingllm" in out


def test_typical_sample_is_the_median_prompt(tmp_path):
    frame = report.load_predictions(write(tmp_path / "run", predictions(samples_per_task=3)))
    task, sid = report.typical_sample(frame)
    assert frame[(frame.task == task) & (frame.id == sid)]["prompt_tokens"].iloc[0] == 400


@pytest.mark.parametrize("content", [None, "", "\n"])
def test_missing_or_empty_predictions_is_one_line_exit_2(content, tmp_path, run_cli):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "predictions.jsonl").write_text(content)
    code, _, err = run_cli("report", str(run))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "predictions.jsonl" in err and "ripplekv eval" in err


def test_methods_with_identical_layer_budgets_share_one_labelled_line():
    from ripplekv.report import shared_lines

    rows = pd.DataFrame({"method": ["streamingllm", "snapkv", "pyramidkv"],
                         "layer_budgets": [[64, 64], [64, 64], [80, 48]]})
    assert shared_lines(rows) == {(64, 64): ["streamingllm", "snapkv"], (80, 48): ["pyramidkv"]}
