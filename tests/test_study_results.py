"""The committed study (`results/study/`, written by `make study`) meets what it promises: >= 40 samples on each of
>= 3 informative tasks for every factorial row, the full allocation x scorer x split grid with LU-KV's and
RippleKV's crossed cells, a page that says its scale first, intervals on their scale, an n on every ranked row, and
one calibration-prompt hash per draw for every calibrated method, and the second model at >= 2 budgets with
>= 30 samples a task and a global-first row. Skipped until the study's results are committed
(it runs for hours on 2 cores); `check_study` is also what a user can run on their own study folder."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from ripplekv.analysis import factorial
from ripplekv.analysis.study_report import calibration_table
from ripplekv.defaults import STUDY_CALIBRATED

STUDY = Path(__file__).resolve().parents[1] / "results" / "study"
MIN_SAMPLES, MIN_TASKS, MIN_DRAWS, MIN_SECOND_SAMPLES = 40, 3, 3, 30
committed = pytest.mark.skipif(not (STUDY / "design.json").is_file(),
                               reason="results/study is not committed yet (`make study` runs for hours)")


def predictions(folder: Path) -> pd.DataFrame:
    lines = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines() if line.strip()]
    return pd.DataFrame(lines)


def informative_tasks(folder: Path, design: dict) -> list[str]:
    table = pd.read_csv(folder / "informative.csv")
    flagged = set(table.loc[table["informative"].astype(bool), "task"])
    return [task for task in design["tasks"] if task.split(":", 1)[-1] in flagged]


def check_samples(folder: Path) -> list[str]:
    """What falls short of n >= 40 on >= 3 informative tasks for every grid row at every budget."""
    design = json.loads((folder / "design.json").read_text())
    tasks = [task.split(":", 1)[-1] for task in informative_tasks(folder, design)]
    problems = [] if len(tasks) >= MIN_TASKS else [f"{len(tasks)} informative tasks: {tasks}"]
    counts = predictions(folder).groupby(["method", "budget", "task"])["id"].nunique()
    for cell in design["cells"]:
        for budget in design["budgets"]:
            for task in tasks:
                n = int(counts.get((cell["method"], float(budget), task), 0))
                if n < MIN_SAMPLES:
                    problems.append(f"{cell['method']} at B={budget} on {task}: {n} samples")
    return problems


def check_grid(folder: Path) -> list[str]:
    """The grid is complete and holds each of LU-KV vs RippleKV's differences as its own cell."""
    design = json.loads((folder / "design.json").read_text())
    cells = pd.DataFrame(design["cells"])
    grid = factorial.complete_grid(cells[["method", *factorial.FACTORS]])
    levels = [set(cells[f]) & set(grid[f]) for f in factorial.FACTORS]
    problems = [] if len(grid) == len(levels[0]) * len(levels[1]) * len(levels[2]) else ["the grid is not complete"]
    have = set(zip(grid["allocation"], grid["scorer"], grid["split"]))
    for wanted in (("lukv", "snapkv", "even"), ("ripplekv", "expected-attention", "adakv")):
        if wanted not in have:
            problems.append(f"no grid cell {wanted}")
    return problems


def check_page(folder: Path) -> list[str]:
    """The page's first paragraph names what was measured; intervals stay on their scale; ranked rows have n."""
    first = (folder / "README.md").read_text().split("\n\n")[1]
    problems = [f"the first paragraph lacks {word!r}" for word in ("**What this measured.**", "Model", "not LongBench",
                                                                    "n per task", "tokens") if word not in first]
    for board_path in sorted(folder.glob("*/leaderboard.csv")):
        board = pd.read_csv(board_path)
        for column in [c for c in board if c.startswith(("avg_informative_ci", "avg_ci"))]:
            values = board[column].dropna()
            if ((values < 0) | (values > 100)).any():
                problems.append(f"{board_path.parent.name}/leaderboard.csv {column} leaves [0, 100]")
        ranked = board[board["rank"].notna()]
        if ranked["n"].isna().any() or (ranked["n"] < board["n"].max()).any():
            problems.append(f"{board_path.parent.name}/leaderboard.csv ranks a row without the table's n")
    return problems


def check_calibration(folder: Path) -> list[str]:
    """One prompt-id hash per draw, shared by every calibrated method, different across >= 3 draws."""
    design = folder / "design.json"
    target = json.loads(design.read_text()).get("target_tokens") if design.is_file() else None
    table = calibration_table(folder, target)
    problems = [] if table["tokens"].notna().all() else ["a calibration row without its tokens"]
    problems += [] if table["draw"].nunique() >= MIN_DRAWS else [f"{table['draw'].nunique()} calibration draws"]
    for draw, rows in table.groupby("draw"):
        if rows["ids_hash"].nunique() != 1:
            problems.append(f"draw {draw}: {rows['ids_hash'].nunique()} prompt-id hashes")
        named = {m.split(" ", 1)[0] for m in rows["method"]}
        if named != set(STUDY_CALIBRATED):
            problems.append(f"draw {draw}: calibrated methods {sorted(named)}")
    if table.groupby("draw")["ids_hash"].first().nunique() != table["draw"].nunique():
        problems.append("two draws share their prompts")
    return problems


def check_second_model(folder: Path) -> list[str]:
    """The second model: >= 30 samples a task at >= 2 budgets for every compressed row, global-first among them."""
    lines = predictions(folder / "second")
    compressed = lines[lines["budget"].notna()]
    budgets = sorted(int(b) for b in compressed["budget"].unique())
    problems = [] if len(budgets) >= 2 else [f"the second model at budgets {budgets}"]
    if not compressed["method"].str.startswith("global-first").any():
        problems.append("no global-first row for the second model")
    counts = compressed.groupby(["method", "budget", "task"])["id"].nunique()
    problems += [f"second model {m} at B={int(b)} on {task}: {n} samples" for (m, b, task), n in counts.items()
                 if n < MIN_SECOND_SAMPLES]
    return problems


@committed
@pytest.mark.parametrize("check", [check_samples, check_grid, check_page, check_calibration, check_second_model])
def test_the_committed_study_meets_its_design(check):
    assert check(STUDY) == []


def test_the_checks_find_what_falls_short(tmp_path):
    """The checks above are not vacuous: a folder missing samples, a cell, a scope line and a draw fails each."""
    design = {"tasks": ["ruler:a", "ruler:b", "ruler:c"], "budgets": [128],
              "cells": [{"method": f"{a}:{s}", "allocation": a, "scorer": s, "split": "even"}
                        for a in ("snapkv", "lukv") for s in ("snapkv", "expected-attention")]}
    (tmp_path / "design.json").write_text(json.dumps(design))
    (tmp_path / "informative.csv").write_text("task,informative\na,True\nb,True\nc,False\n")
    lines = [{"id": f"{t}-{i}", "task": t, "method": cell["method"], "budget": 128}
             for cell in design["cells"] for t in ("a", "b") for i in range(40 if t == "a" else 12)]
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    said = check_samples(tmp_path)
    assert said[0] == "2 informative tasks: ['a', 'b']" and "lukv:snapkv at B=128 on b: 12 samples" in said
    assert "no grid cell ('ripplekv', 'expected-attention', 'adakv')" in check_grid(tmp_path)
    (tmp_path / "README.md").write_text("# The study\n\n**What this measured.** Model `m`; 3 tasks.\n")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "leaderboard.csv").write_text("method,budget,rank,n,avg_informative_ci_high\n"
                                                       "snapkv,128,1,40,108.07\nlukv,128,2,12,50\n")
    page = check_page(tmp_path)
    assert "the first paragraph lacks 'not LongBench'" in page
    assert "eval/leaderboard.csv avg_informative_ci_high leaves [0, 100]" in page
    assert "eval/leaderboard.csv ranks a row without the table's n" in page
    for draw, ids in ((0, {"ripplekv": "abc", "lukv": "abc", "compresskv": "abc"}), (1, {"ripplekv": "abc", "lukv": "de"})):
        folder = tmp_path / "calibration" / f"d{draw}"
        files = {"ripplekv": folder / "profile" / "profile.json", "lukv": folder / "lukv" / "curve-snapkv.json",
                 "compresskv": folder / f"compresskv-d{draw}.json"}
        for method, letters in ids.items():
            files[method].parent.mkdir(parents=True, exist_ok=True)
            files[method].write_text(json.dumps({"calibration_ids": list(letters), "target_tokens": 100}))
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "predictions.jsonl").write_text("".join(
        json.dumps({"id": f"t-{i}", "task": "t", "method": "snapkv", "budget": 128}) + "\n" for i in range(30)))
    assert check_second_model(tmp_path) == ["the second model at budgets [128]",
                                            "no global-first row for the second model"]
    assert check_calibration(tmp_path) == ["2 calibration draws", "draw 1: 2 prompt-id hashes",
                                           "draw 1: calibrated methods ['lukv', 'ripplekv']",
                                           "two draws share their prompts"]  # draw 1's first hash is draw 0's
