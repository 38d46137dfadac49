"""`ripplekv study`: its config, equal calibration across methods and draws, the factorial grid, the n rule, and
the page's p-values recomputed here by an independent exact sign-flip and Holm."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis import factorial, study_page
from ripplekv.analysis.study_power import detectable_at, required_limit
from ripplekv.analysis.study_report import calibration_table, write_study_page
from ripplekv.errors import UserError
from ripplekv.pipeline.study import plan
from ripplekv.pipeline.study.config import load_study_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "study.toml"
CHOICE = plan.Choice("smollm2-135m", "ruler", 2048, ("niah_single_1", "vt", "cwe"))
SAME_PROMPTS = ("--model", "--calib-tasks", "--calib-samples", "--calib-draws", "--target-tokens")


def option(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_calibrated_allocation_is_fitted_on_the_same_prompts_in_each_draw():
    config = load_study_config(CONFIG)
    seen_draws = set()
    for draw in range(config.draws):
        stages = plan.calibration_stages(config, CHOICE, "OUT", draw)
        assert [s.name for s in stages] == [f"profile-d{draw}", f"allocate-d{draw}", f"fit-lukv-d{draw}",
                                            f"fit-compresskv-d{draw}"]
        argvs = [s.command.shown for s in stages]
        # one calibration for all: the same tasks, count, draw, length and model in every fitter of the draw
        assert {tuple(option(a, name) for name in (*SAME_PROMPTS, "--calib-draw")) for a in argvs} == {
            ("smollm2-135m", "ruler:niah_single_1,ruler:vt,ruler:cwe", str(config.calib_samples), str(config.draws),
             "2048", str(draw))}
        seen_draws.add(option(argvs[0], "--calib-draw"))
        lukv = argvs[2]
        assert option(lukv, "--methods") == "lukv:scorer=snapkv,lukv:scorer=expected-attention,lukv"
        assert option(argvs[1], "--out") == f"OUT/calibration/d{draw}/ripplekv-d{draw}.csv"
    assert seen_draws == {"0", "1", "2"}


def test_the_grid_crosses_every_allocation_scorer_and_split_with_each_draws_files():
    config = load_study_config(CONFIG)
    files = plan.fitted_files(config, "OUT", 1)
    grid = plan.grid_specs(config, files)
    assert len(grid) == len(config.allocations) * len(config.scorers) * len(config.splits) == 24
    assert len(set(grid)) == 24
    assert "lukv:curve=OUT/calibration/d1/curve-snapkv-d1.csv:scorer=snapkv:split=adakv" in grid
    assert "ripplekv:allocation=OUT/calibration/d1/ripplekv-d1.csv:scorer=expected-attention:split=even" in grid
    assert "pyramidkv:scorer=snapkv:split=even" in grid
    extras = plan.extra_specs(config, files)
    assert extras == ["full", "streamingllm", "lukv:curve=OUT/calibration/d1/curve-lukv-d1.csv"]
    calibrated = plan.calibrated_specs(config, files)
    # what a further draw evaluates again: the calibrated cells (3 allocations x 4) and LU-KV as published
    assert len(calibrated) == 13 and all("-d1." in spec for spec in calibrated)
    copies = plan.curve_copies(config, "OUT", 1)
    assert (Path("OUT/calibration/d1/lukv/curve-snapkv.csv"), Path("OUT/calibration/d1/curve-snapkv-d1.csv")) in copies


@pytest.mark.parametrize("change, message", [
    ('pair = ["lukv", "h2o"]', "must name two of allocations"),
    ('allocations = ["snapkv", "h2o"]', "h2o cannot be a study allocation"),
    ("min_limit = 80", "min_limit (80) is above max_limit"),
    ("max_tasks = 2", "min_tasks (3) is above max_tasks (2)"),
    ("draws = 1", "at least 2 draws"),
    ("budgets = [0]", "is not a positive integer"),
    ("bogus = 1", "unknown setting 'bogus'"),
])
def test_a_bad_study_config_is_one_line(tmp_path, change, message):
    key = change.split(" = ")[0]
    lines = [line for line in CONFIG.read_text().splitlines() if not line.startswith(f"{key} =")]
    path = tmp_path / "study.toml"
    path.write_text("\n".join([*lines, change]) + "\n")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_study_config(path)


def test_the_study_keeps_its_max_tasks_widest_margin_tasks_and_its_page_says_so(tmp_path):
    entry = {"suite": "ruler", "target_tokens": 2048, "tasks": ["ruler:niah_single_1", "ruler:vt", "ruler:fwe",
                                                                 "ruler:cwe"], "enough_tasks": True}
    other = {"suite": "offline", "target_tokens": 1024, "tasks": ["offline:niah", "offline:squad"],
             "enough_tasks": False}
    path = tmp_path / "screen.choice.json"
    path.write_text(json.dumps({"rule": "r", "model": "a", **entry, "per_model": {"a": entry, "b": other}}))
    main, second = plan.read_choices(path, 3)
    assert main.tasks == ("niah_single_1", "vt", "fwe") and second.tasks == ("niah", "squad")
    out = tmp_path / "study"
    write_study_folder(out)
    (out / "screen").mkdir()
    (out / "screen" / "screen.choice.json").write_text(json.dumps({"rule": "r", "tasks": ["x:t1", "x:t2", "x:t3"]}))
    design = json.loads((out / "design.json").read_text())
    (out / "design.json").write_text(json.dumps({**design, "max_tasks": 2}))
    page = write_study_page(out, "results/study").read_text()
    assert "tasks t1, t2 (the 2 widest-margin of the 3 informative ones: max_tasks = 2" in page


def test_n_per_task_is_the_smallest_whose_detectable_difference_is_meaningful():
    rng = np.random.default_rng(3)
    rows = []
    for task in ("a", "b"):
        for i in range(12):
            base = rng.normal(0.5, 0.1)
            diff = rng.normal(0.02, 0.09)
            rows += [{"task": task, "id": f"{task}{i}", "method": "x", "budget": 128, "kl": base},
                     {"task": task, "id": f"{task}{i}", "method": "y", "budget": 128, "kl": base + diff}]
    frame = pd.DataFrame(rows)
    power = required_limit(frame, [("x", "y")], [128], 0.05, 10, 200)
    differences = frame.pivot_table(index=["task", "id"], columns="method", values="kl")
    variances = [np.var((g["y"] - g["x"]).to_numpy(), ddof=1) for _, g in differences.groupby(level=0)]
    m = power["limit"]
    # independent check of the rule: at m the detectable difference is within 0.05, at m - 1 it is not
    from scipy import stats

    def mdd(n):
        se = math.sqrt(np.mean(variances) / (2 * n))
        return (stats.t.ppf(0.975, 2 * (n - 1)) + stats.t.ppf(0.8, 2 * (n - 1))) * se

    assert mdd(m) <= 0.05 < mdd(m - 1)
    assert detectable_at(np.array(variances), m) == pytest.approx(mdd(m))
    assert power["capped"] is False
    capped = required_limit(frame, [("x", "y")], [128], 0.001, 10, 20)
    assert capped["limit"] == 20 and capped["capped"] is True


def grid_frame(seed: int = 0, samples: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Predictions of a 3 x 2 x 2 grid on 2 tasks x `samples` samples at two budgets, and its cells."""
    rng = np.random.default_rng(seed)
    cells = [(f"{a}|{s}|{p}", a, s, p) for a in ("uniform", "lukv", "ripplekv") for s in ("snapkv", "ea")
             for p in ("even", "adakv")]
    shift = {"uniform": 0.3, "lukv": 0.1, "ripplekv": 0.15}
    rows = []
    for budget in (128, 256):
        for task in ("t1", "t2"):
            for i in range(samples):
                base = rng.uniform(0.2, 0.6)
                for label, a, s, _ in cells:
                    rows.append({"task": task, "id": f"{task}-{i}", "method": label, "budget": budget,
                                 "kl": base + shift[a] / (budget / 128) + rng.normal(0, 0.05) + (s == "ea") * 0.02,
                                 "score": 1.0, "agreement": 0.9, "category": "Synthetic"})
    return pd.DataFrame(rows), pd.DataFrame(cells, columns=["method", *factorial.FACTORS])


def exact_sign_flip(per_sample: np.ndarray, tasks: np.ndarray) -> float:
    """Every sign pattern, written out: the share whose stratified mean is at least as far from 0."""
    names = sorted(set(tasks))
    weight = np.array([1 / (len(names) * (tasks == t).sum()) for t in tasks])
    terms = weight * per_sample
    observed = abs(terms.sum())
    hits = sum(abs(sum(sign * term for sign, term in zip(signs, terms))) >= observed - 1e-12
               for signs in itertools.product((1, -1), repeat=len(terms)))
    return hits / 2 ** len(terms)


def holm_by_hand(p: list[float]) -> list[float]:
    order = sorted(range(len(p)), key=lambda i: p[i])
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def test_the_study_p_values_match_an_independent_exact_sign_flip_and_holm():
    frame, cells = grid_frame()
    effects = study_page.with_ids(factorial.effects(frame, cells, pair=("lukv", "ripplekv"), reference="uniform"))
    for budget, rows in effects.groupby("budget"):
        lines = frame[frame["budget"] == budget]
        wide = lines.pivot_table(index=["task", "id"], columns="method", values="kl")
        tasks = np.array([task for task, _ in wide.index])
        pair = np.mean([wide[f"ripplekv|{s}|{p}"] - wide[f"lukv|{s}|{p}"] for s in ("snapkv", "ea")
                        for p in ("even", "adakv")], axis=0)
        row = rows[rows["effect"] == "ripplekv - lukv"].iloc[0]
        assert row["p"] == pytest.approx(exact_sign_flip(pair, tasks), abs=1e-12)
        assert row["delta"] == pytest.approx(np.mean([pair[tasks == t].mean() for t in ("t1", "t2")]))
        # the Holm family is the budget's whole table
        assert rows["p_holm"].to_numpy() == pytest.approx(holm_by_hand(list(rows["p"])))
    primary = study_page.primary(effects, "ripplekv - lukv")
    assert list(primary["id"]) == ["P-128", "P-256"]
    assert primary["p_holm"].to_numpy() == pytest.approx(holm_by_hand(list(primary["p"])))


def write_study_folder(out: Path) -> None:
    frame, cells = grid_frame(samples=6)
    (out / "eval").mkdir(parents=True)
    with (out / "eval" / "predictions.jsonl").open("w") as handle:
        for row in frame.to_dict("records"):
            handle.write(json.dumps(row) + "\n")
    (out / "eval" / "config.json").write_text(json.dumps({"suite": "ruler", "model_label": "smollm2-135m",
                                                 "samples": {"t1": [f"t1-{i}" for i in range(6)],
                                                             "t2": [f"t2-{i}" for i in range(6)]}}))
    (out / "design.json").write_text(json.dumps({
        "cells": cells.to_dict("records"), "pair": ["lukv", "ripplekv"], "reference": "uniform", "meaningful": 0.05,
        "budgets": [128, 256], "model": "smollm2-135m", "suite": "ruler", "target_tokens": 2048,
        "tasks": ["t1", "t2"], "second_model": None, "config": "configs/study.toml"}))
    (out / "power.json").write_text(json.dumps({"limit": 40, "capped": False, "rule": "the rule"}))
    stages = ["stage,seconds"]
    for draw in range(3):
        folder = out / "calibration" / f"d{draw}"
        ids = [f"cal-{draw}-{i}" for i in range(6)]
        (folder / "profile").mkdir(parents=True)
        (folder / "lukv").mkdir()
        (folder / "profile" / "profile.json").write_text(json.dumps({"calibration_ids": ids, "target_tokens": 2048}))
        (folder / "lukv" / "curve-snapkv.json").write_text(json.dumps({"calibration_ids": ids, "target_tokens": 2048}))
        (folder / f"compresskv-d{draw}.json").write_text(json.dumps({"calibration_ids": ids, "target_tokens": 2048}))
        stages += [f"profile-d{draw},10", f"allocate-d{draw},5", f"fit-lukv-d{draw},30", f"fit-compresskv-d{draw},7"]
    (out / "stages.csv").write_text("\n".join(stages) + "\n")


def test_the_page_says_what_it_measured_first_and_its_verdict_rests_on_table_rows(tmp_path):
    out = tmp_path / "study"
    write_study_folder(out)
    table = calibration_table(out)
    assert len(table) == 9 and table.groupby("draw")["ids_hash"].nunique().eq(1).all()  # one hash per draw
    assert table["ids_hash"].nunique() == 3 and set(table["prompts"]) == {6} and set(table["tokens"]) == {12288}
    assert table[table["method"].str.startswith("ripplekv")]["seconds"].tolist() == [15.0, 15.0, 15.0]
    page = write_study_page(out, "results/study").read_text()
    first = page.split("\n\n")[1]
    assert first.startswith("**What this measured.**") and "not LongBench" in first and "t1 6, t2 6" in first
    assert "not for larger models" in first and "shows the harness end to end" not in first  # a study, not a smoke run
    verdict = page.split("## Verdict\n\n", 1)[1].split("\n", 1)[0]
    assert "(P-128)" in verdict and "(P-256)" in verdict
    for row_id in {*__import__("re").findall(r"\((F-\d+-\d+)\)", verdict)}:
        assert f"| {row_id} |" in page
    assert "| ripplekv (profile + ratio) | 0 |" in page
    assert "![factorial effects](factorial_effects.png)" in page and (out / "factorial_effects.png").stat().st_size > 1000
    assert "**Time:** the stages took 0 h 2 min on this machine" in page  # 3 draws x (10 + 5 + 30 + 7) s
    (out / "sittings.csv").write_text(f"started_utc,commit\n2026-12-06 10:00:00,{'a' * 40}\n"
                                      f"2026-12-06 11:00:00,{'a' * 40}\n2026-12-06 12:00:00,{'b' * 40}+dirty\n")
    page = write_study_page(out, "results/study").read_text()
    assert f"It ran in 3 sitting(s) at commit(s) `{'a' * 12}`, `{'b' * 12}+dirty` (`sittings.csv`)." in page


def test_a_sitting_records_the_commit_of_the_code_running_it(tmp_path):
    import re

    from ripplekv.pipeline.study.run import record_sitting, source_commit

    commit = source_commit()
    if (Path(__file__).resolve().parent.parent / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    else:  # a copy without its history
        assert commit == "unknown"
    record_sitting(str(tmp_path))
    record_sitting(str(tmp_path))
    table = pd.read_csv(tmp_path / "sittings.csv")
    assert list(table.columns) == ["started_utc", "commit"] and list(table["commit"]) == [commit, commit]


def tiny_config(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "study.toml"
    path.write_text(f'''out = "results/study"
screen_models = ["{model}"]
screen_suites = ["offline:niah,hotpotqa"]
screen_lengths = [300]
screen_limit = 2
min_tasks = 1
max_tasks = 2
draws = 2
calib_samples = 2
seeds = 1
eta = 0.3
probe_tokens = 4
ratios = [2, 4]
sweep_budget = 32
allocations = ["snapkv", "ripplekv", "lukv", "compresskv"]
scorers = ["snapkv", "expected-attention"]
splits = ["even", "adakv"]
extra_methods = ["full", "lukv"]
pair = ["lukv", "ripplekv"]
budgets = [32, 64]
meaningful = 0.05
pilot_limit = 2
min_limit = 2
max_limit = 3
draws_limit = 2
second_methods = ["full", "snapkv", "ripplekv"]
second_budgets = [32, 64]
second_limit = 2
''')
    return path


@pytest.mark.slow
def test_the_study_runs_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    """Every stage for real on a tiny model. Its random weights answer nothing, so the screen's choice is placed
    as a finished screen stage (what a resumed run finds); the second model is the same weights by another path."""
    from ripplekv.pipeline.staged import StagedRun
    from ripplekv.pipeline.study import study

    monkeypatch.chdir(tmp_path)
    model = str(tiny_model_dir)
    config_path = tiny_config(tmp_path, model)
    config = load_study_config(config_path)
    run = StagedRun(config.out)
    run.begin()
    entry = {"suite": "offline", "target_tokens": 300, "tasks": ["offline:niah", "offline:hotpotqa"],
             "enough_tasks": True}
    screen = Path(run.path("screen"))
    screen.mkdir(parents=True)
    (screen / "screen.choice.json").write_text(json.dumps({"rule": "placed by the test", "model": model, **entry,
                                                           "per_model": {model: entry, f"{model}/.": entry}}))
    Path(run.out, ".screen.cmd").write_text(run.record(plan.screen_command(config, run.path("screen")).shown) + "\n")
    study(str(config_path))
    out = Path("results/study")
    design = json.loads((out / "design.json").read_text())
    assert len([c for c in design["cells"] if c["allocation"] != "lukv" or c["split"] != "curve"]) == 16
    power = json.loads((out / "power.json").read_text())
    assert 2 <= power["limit"] <= 3
    frame = pd.read_json(out / "predictions.jsonl", lines=True)  # the eval's, linked at the top
    assert (out / "predictions.jsonl").resolve() == (out / "eval" / "predictions.jsonl").resolve()
    assert frame.groupby("task")["id"].nunique().eq(power["limit"]).all()
    table = calibration_table(out)
    # every calibrated method of a draw on the same prompts; the two draws on different ones
    assert table.groupby("draw")["ids_hash"].nunique().eq(1).all() and table["ids_hash"].nunique() == 2
    assert set(table["method"]) == {"ripplekv (profile + ratio)", "compresskv", "lukv (snapkv curve)",
                                    "lukv (expected-attention curve)", "lukv (lukv curve)"}
    assert len(pd.read_csv(out / "sittings.csv")) == 1
    spread = pd.read_csv(out / "calibration_spread.csv")
    assert len(spread) > 0
    assert (out / "second" / "predictions.jsonl").is_file()
    page = (out / "README.md").read_text()
    assert "(P-32)" in page and "(P-64)" in page and "## The second model" in page and "KL - nan" not in page
    verdict = page.split("## Verdict\n\n", 1)[1].split("\n", 1)[0]
    for budget in config.second_budgets:  # the second model's own sentence per budget, from its leaderboard
        assert f"On the second model (`{design['second_model']}`) at B={budget}, " in verdict


@pytest.mark.parametrize("per_cell, labelled", [(1, True), (9, True), (10, False)])
def test_a_needle_heatmap_under_ten_samples_a_cell_is_labelled_illustrative(tmp_path, per_cell, labelled):
    from ripplekv.analysis.page_evals import needle_lines

    (tmp_path / "needle").mkdir()
    rows = [{"method": "full", "budget": None, "length": n, "depth": d, "n": per_cell, "accuracy": 100.0, "kl": 0.0}
            for n in (1024, 2048) for d in (0, 50, 100)]
    pd.DataFrame(rows).to_csv(tmp_path / "needle" / "needle.csv", index=False)
    text = "\n".join(needle_lines(tmp_path))
    assert ("(illustrative)" in text) is labelled and ("Illustrative only" in text) is labelled
    if labelled:
        assert f"{per_cell} sample(s) a cell" in text


def test_the_results_page_links_the_study_and_quotes_its_verdict(tmp_path):
    from ripplekv.analysis.results_page import study_lines

    assert "it is not in this folder yet" in study_lines(tmp_path)[1]
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "README.md").write_text("# The study\n\n## Verdict\n\nAt B=128, x and y are tied (P-128).\n")
    line = study_lines(tmp_path)[1]
    assert "[study/README.md](study/README.md)" in line and line.endswith("At B=128, x and y are tied (P-128).")
