"""The study's task screen: eval on the calibration split, the cells' verdicts collected, the choice rule."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ripplekv.errors import UserError
from ripplekv.pipeline import screen


def verdicts(rows: list[tuple]) -> pd.DataFrame:
    """(model, task, length, informative, margin_low) -> a screen table."""
    return pd.DataFrame([{"model": m, "suite": "ruler", "task": t, "target_tokens": n, "samples": 8,
                          "full_score": 80.0, "trivial_score": 10.0, "margin": 70.0, "margin_low": low,
                          "informative": ok} for m, t, n, ok, low in rows], columns=screen.COLUMNS)


def test_the_choice_takes_the_longest_length_with_enough_tasks_and_the_model_with_most():
    table = verdicts([
        ("a", "vt", 1024, True, 50), ("a", "cwe", 1024, True, 60), ("a", "qa_1", 1024, True, 5),
        ("a", "vt", 2048, True, 40), ("a", "cwe", 2048, True, 30), ("a", "qa_1", 2048, True, 20),
        ("a", "vt", 4096, True, 40), ("a", "cwe", 4096, False, -1), ("a", "qa_1", 4096, True, 2),
        ("b", "vt", 1024, True, 90), ("b", "cwe", 1024, True, 90), ("b", "qa_1", 1024, True, 90),
        ("b", "fwe", 1024, True, 90),
    ])
    choice = screen.choose(table, 3, ["a", "b"])
    assert choice["per_model"]["a"] == {"suite": "ruler", "target_tokens": 2048,
                                        "tasks": ["ruler:vt", "ruler:cwe", "ruler:qa_1"], "enough_tasks": True}
    assert choice["model"] == "b" and choice["target_tokens"] == 1024 and len(choice["tasks"]) == 4
    # a tie in task count goes to the model listed first
    assert screen.choose(table, 3, ["b", "a"])["model"] == "b"
    assert screen.choose(table[table["model"] == "a"], 3, ["b", "a"])["model"] == "a"


def test_a_model_short_of_informative_tasks_takes_its_best_length_and_says_so():
    table = verdicts([("a", "vt", 1024, True, 5), ("a", "cwe", 1024, False, -3),
                      ("a", "vt", 2048, False, -1), ("a", "cwe", 2048, False, -2)])
    choice = screen.choose(table, 3, ["a"])
    assert choice["target_tokens"] == 1024 and choice["tasks"] == ["ruler:vt"] and choice["enough_tasks"] is False
    with pytest.raises(UserError, match="no verdicts"):
        screen.choose(table.iloc[0:0], 3, ["a"])


def test_the_choice_keeps_one_suite_the_one_with_most_informative_tasks():
    ruler = verdicts([("a", "vt", 1024, True, 50), ("a", "cwe", 1024, True, 60), ("a", "qa_1", 1024, False, -5)])
    offline = verdicts([("a", "niah", 1024, True, 80), ("a", "hotpotqa", 1024, True, 70),
                        ("a", "squad", 1024, True, 3)]).assign(suite="offline")
    choice = screen.choose(pd.concat([ruler, offline], ignore_index=True), 3, ["a"])
    assert choice["suite"] == "offline" and choice["tasks"] == ["offline:niah", "offline:hotpotqa", "offline:squad"]
    # tasks of two suites are never mixed, even when together they would reach min_tasks
    choice = screen.choose(pd.concat([ruler, offline.iloc[:1]], ignore_index=True), 3, ["a"])
    assert choice["suite"] == "ruler" and choice["tasks"] == ["ruler:cwe", "ruler:vt"]


def test_eval_reads_the_calibration_split_when_asked(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "cal"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah",
                           "--limit", "2", "--target-tokens", "300", "--methods", "full", "--budget", "64",
                           "--split", "calibration", "--out", str(out))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["split"] == "calibration"
    assert all("calibration" in sid for sid in config["samples"]["niah"]) and len(config["samples"]["niah"]) == 2
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "longbench", "--data-dir",
                           str(tmp_path), "--methods", "full", "--budget", "64", "--split", "calibration",
                           "--out", str(tmp_path / "lb"))
    assert code == 2 and "--split calibration needs a generated suite" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_screen_runs_each_cell_and_writes_its_table_and_choice(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "screen"
    args = ["screen", "--models", str(tiny_model_dir), "--suite", "offline:niah,hotpotqa", "--lengths", "300,400",
            "--limit", "2", "--min-tasks", "1", "--out", str(out)]
    code, _, err = run_cli(*args)
    assert code == 0, err
    table = pd.read_csv(out / screen.SCREEN_CSV)
    # 400 tokens are screened only if 300 kept min_tasks (1) informative: prompts lengthen while informative
    found = int((table[table["target_tokens"] == 300]["informative"].astype(str) == "True").sum())
    lengths = (300, 400) if found >= 1 else (300,)
    assert sorted(zip(table["task"], table["target_tokens"])) == sorted(
        (task, n) for task in ("hotpotqa", "niah") for n in lengths)
    assert (table["samples"] == 2).all()
    choice = json.loads((out / screen.CHOICE_JSON).read_text())
    assert choice["model"] == screen.model_label(str(tiny_model_dir)) and choice["target_tokens"] in (300, 400)
    before = (out / screen.SCREEN_CSV).read_text()
    code, _, err = run_cli(*args)  # a rerun resumes: every cell is complete, nothing changes
    assert code == 0, err
    assert (out / screen.SCREEN_CSV).read_text() == before
    code, _, err = run_cli("screen", "--suite", "longbench", "--out", str(tmp_path / "x"))
    assert code == 2 and "only the generated suites" in err
