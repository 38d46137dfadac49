"""scripts/reproduce.sh with a stand-in `ripplekv`: OUT is replaced only when every stage succeeded."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Writes what each stage's real command writes (enough for write_results_readme.py); fails at $FAIL_AT.
FAKE_RIPPLEKV = r'''#!/usr/bin/env python3
import json, os, sys
from pathlib import Path
stage, args = sys.argv[1], sys.argv[2:]
if os.environ.get("FAIL_AT") == stage:
    sys.exit(f"{stage} failed")
out = Path(args[args.index("--out") + 1])
draw = args[args.index("--calib-draw") + 1] if "--calib-draw" in args else ""
if stage == "profile":
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensitivity.csv").write_text("layer,kl_mean\n0,1\n")
    signal = args[args.index("--signal") + 1] if "--signal" in args else "noise"
    measure = args[args.index("--measure") + 1] if "--measure" in args else None
    column = {"task-drop": "drop"}.get(measure, "infonce" if signal == "infonce" else "kl")
    (out / "per_sample.csv").write_text(f"sample_id,seed,layer,{column}\n" + "".join(
        f"{sid}{draw},0,{layer},{(layer + 1) * (2 if sid == 'a' else 1) + (sid == 'b') * layer ** 2}\n"
        for sid in ("a", "b") for layer in range(3)))
    (out / "profile.json").write_text(json.dumps({"model": "m", "signal": signal, "eta": 0.3, "seeds": 1,
        "probe_tokens": 16, "calibration_ids": ["a" + draw, "b" + draw], "split_half_spearman": None, "evict_budget": 128,
        **({"measure": measure, "prune_ratio": 0.6, "evict_method": "h2o"} if measure else {})}))
elif stage == "allocate":
    out.write_text("layer,multiplier\n0,1\n1,1\n")
    if args.count("--ratio") > 1:
        (out.parent / (out.stem + ".choice.json")).write_text(json.dumps({"ratio": 4 + 4 * (draw == "1"),
            "candidates": [2, 4, 8, 16], "initial": [2, 4], "extensions": 2, "notes": [], "budget": 128}))
        (out.parent / (out.stem + ".sweep.csv")).write_text("ratio,kl,chosen\n2,0.5,False\n4,0.4,True\n")
elif stage == "route":
    out.mkdir(parents=True, exist_ok=True)
    methods = ["snapkv", "h2o"] if draw == "1" else ["snapkv", "snapkv"]
    (out / "ROUTE.csv").write_text("layer,method\n" + "".join(f"{i},{m}\n" for i, m in enumerate(methods)))
    (out / "route.json").write_text(json.dumps({"budget": 128, "method_counts": {"snapkv": 1, "h2o": 0},
        "calibration_ids": ["a", "b"], "placement_ids": ["c"], "placement_rank": 2, "placements_scored": 3,
        "split_half": {"agreement": 1, "layers": 2, "chance": 1.0, "samples": [1, 1]}}))
elif stage == "tune":
    out.write_text(json.dumps({"budget": 128, "calibration_ids": ["a0", "b0"], "tuned": {"cake": "cake:tau1=2"},
        "methods": {"cake": {"spec": "cake:tau1=2", "grid": "cake:tau1=0.5,1", "summary": "chose tau1 2"}}}))
elif "--decode-budget" in args:
    out.mkdir(parents=True, exist_ok=True)
    total = args[args.index("--decode-budget") + 1] == "total"
    lines = []
    for method, budget, kept in (("full", None, 2000), ("snapkv", 64, 64)):
        row = {"task": "paragraph_recall", "method": method, "budget": budget, "score": 0.5, "kl": 0.1,
               "new_tokens": 101, "layer_budgets": [kept, kept]}
        if total:
            row.update(decode_budget="total", peak_entries=2100 if budget is None else budget)
        lines.append(json.dumps(row))
    (out / "predictions.jsonl").write_text("\n".join(lines) + "\n")
else:
    out.mkdir(parents=True, exist_ok=True)
    specs = args[args.index("--methods") + 1].split(",")

    def make_label(spec):  # the label rule of methods.core.spec: sorted options, files by their name
        name, *options = spec.split(":")
        pairs = sorted(option.split("=", 1) for option in options)
        return name + "".join(f":{k}={Path(v).name if k in ('allocation', 'route', 'profile') else v}" for k, v in pairs)

    budgets = [int(args[i + 1]) for i, a in enumerate(args) if a == "--budget"]
    lines = []
    for sample in range(3):
        for index, spec in enumerate(specs):
            label = make_label(spec)
            for budget in [None] if label == "full" else budgets:
                lines.append(json.dumps({"id": f"s{sample}", "task": "niah", "category": "Synthetic", "method": label,
                    "budget": budget, "score": 1.0 if label == "full" else 0.5, "agreement": 1.0,
                    "kl": 0.0 if label == "full" else 0.1 * (1 + index + sample) / (budget or 1)}))
    (out / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    (out / "summary.md").write_text("# eval\n\n| method |\n")
    (out / "config.json").write_text(json.dumps({"samples": {"niah": ["s0", "s1"]}}))
    head = "method,budget,kl,agreement,versus,kl_delta_vs_uniform,kl_delta_ci_low,kl_delta_ci_high,"
    head += "p_kl_vs_uniform_holm,kl_verdict,avg_informative,avg"
    (out / "leaderboard.csv").write_text(head + "\nfull,,0,1,,,,,,,30,20\n"
        "snapkv,128,0.5,0.7,snapkv,0,,,,baseline,12,8\ncriticalkv,128,0.4,0.75,snapkv,-0.1,-0.2,-0.05,0.01,closer,13,9\n"
        "oracle,128,0.25,0.9,snapkv,-0.25,-0.3,-0.2,0.001,answer-aware,20,15\n")
    (out / "headline.csv").write_text(
        "scope,budget,samples,closest,closest_kl,runner_up,runner_up_kl,kl_delta,kl_ci_low,kl_ci_high,p_kl,p_kl_holm,"
        "kl_verdict,kl_mdd,closest_score,runner_up_score,score_delta,score_ci_low,score_ci_high,p_score,p_score_holm,"
        "score_verdict,score_mdd\n"
        "all methods,128,2,criticalkv,0.4,snapkv,0.5,-0.1,-0.2,0.05,0.3,0.3,tied,0.3,13,12,1,-2,4,0.5,0.5,tied,8\n")
    (out / "informative.csv").write_text("task,samples,full_score,trivial_answer,trivial_score,margin,margin_low,informative\n"
                                         "niah,2,100,x,0,100,80,True\ncode,2,1.5,```,40,-38.5,-60,False\n")
    if any("kivi" in spec for spec in specs):  # a quantized variant: the report's memory-axis table
        (out / "memory_axis.md").write_text("## Memory axis\n\n| budget | method | bits |\n|---|---|---|\n"
                                            "| 128 | snapkv:quant=kivi:bits=4 | 4 |\n")
'''

CONFIG = """MODEL=
OUT=results
CALIB_SAMPLES=2
SEEDS=1
ETA=0.3
PROBE_TOKENS=16
RATIOS="4"
SWEEP_SAMPLES=2
SWEEP_BUDGET=128
SUITE=offline
BUDGETS="64 128"
METHODS=full,snapkv,ripplekv
LIMIT=1
TARGET_TOKENS=2000
"""
OPTIONAL_STAGES = """EVICT_CALIB_SAMPLES=2
ROUTE_CALIB_SAMPLES=2
ROUTE_BUDGET=128
PLACEMENTS=3
PLACEMENT_SAMPLES=1
METHODS=full,snapkv,ripplekv,depthkv,routed
HEADLINE_METHODS=full,h2o,depthkv
DEPTHKV_FLOOR=0.25
"""

# configs/gemma3.env's shape: the second model's own run into a folder of results/ (the bundled model stands in for
# Gemma here: the stand-in ripplekv ignores --model, and the pre-flight need not assemble Gemma's GGUF)
GEMMA = CONFIG.replace("OUT=results\n", "OUT=results/gemma3\n")


# The stand-in runs skip reproduce.sh's pre-flight (scripts/check_config.py imports torch and transformers: ~7 s a
# run); the real one refuses bad configs in `project_with_preflight` and accepts every config used here in
# test_the_preflight_accepts_every_config_the_stand_in_runs_use.
PREFLIGHT_SKIPPED = "# the stand-in runs' pre-flight (tests/test_reproduce.py): every config passes\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of scripts/ with the stand-in ripplekv, the test's Python as .venv/bin/python and no pre-flight."""
    shutil.copytree(REPO / "scripts", tmp_path / "scripts")
    (tmp_path / "scripts" / "check_config.py").write_text(PREFLIGHT_SKIPPED)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "reproduce.env").write_text(CONFIG)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "ripplekv").write_text(FAKE_RIPPLEKV.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
    for name in ("python", "ripplekv"):
        (venv / name).chmod((venv / name).stat().st_mode | stat.S_IEXEC)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "committed.txt").write_text("the committed results\n")
    return tmp_path


@pytest.fixture
def project_with_preflight(project: Path) -> Path:
    shutil.copy(REPO / "scripts" / "check_config.py", project / "scripts" / "check_config.py")
    return project


def reproduce(project: Path, fail_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAIL_AT": fail_at or ""}
    return subprocess.run(["bash", "scripts/reproduce.sh", "configs/reproduce.env"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_depthkv_and_route_stages_feed_eval_and_the_results_page(project):
    config = project / "configs" / "reproduce.env"
    config.write_text(CONFIG + OPTIONAL_STAGES)
    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    results = project / "results"
    assert (results / "profile-evict" / "sensitivity.csv").is_file() and (results / "depthkv.csv").is_file()
    readme = (results / "README.md").read_text()
    assert "--methods full,snapkv,ripplekv,depthkv:allocation=results/depthkv.csv,routed" in readme
    assert "--route results/route/ROUTE.csv" in readme and "--signal evict" in readme and "--map proportional" in readme
    assert "## DepthKV profile and allocation" in readme
    assert "route ranks **2 of 4**" in readme and "snapkv 1, h2o 0" in readme
    assert "--measure task-drop --prune-ratio 0.6" in readme and "pruned by 60%" in readme
    assert "--map proportional --floor 0.25" in readme
    predictors = (results / "predictors.csv").read_text()
    assert predictors.count("\n") == 4 and "infonce" in predictors and "Spearman rho with the drop" in readme
    assert "--budget 800 --methods full,h2o,depthkv:allocation=results/depthkv.csv" in readme  # 0.4 x 2000 tokens
    assert "`depthkv:allocation=depthkv.csv` against `h2o` at the headline ratio (3 samples, paired)" in readme
    assert (results / "eval-headline" / "predictions.jsonl").is_file()
    # Without the optional settings the stages are skipped and eval gets neither flag.
    config.write_text(CONFIG)
    shutil.rmtree(results)
    again = reproduce(project)
    assert again.returncode == 0, again.stderr
    readme = (results / "README.md").read_text()
    assert "--route" not in readme and "depthkv" not in readme.lower() and "## Layer-wise routing" not in readme


@pytest.mark.slow
def test_a_failed_run_leaves_results_untouched_and_the_next_one_resumes_and_replaces_them(project):
    failed = reproduce(project, fail_at="eval")
    assert failed.returncode != 0
    assert sorted(p.name for p in (project / "results").iterdir()) == ["committed.txt"]
    assert (project / "runs" / ".staging" / "results" / "profile" / "sensitivity.csv").is_file()

    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    assert "profile: up to date" in done.stdout and "allocate: up to date" in done.stdout
    results = project / "results"
    assert (results / "eval" / "predictions.jsonl").is_file() and not (results / "committed.txt").exists()
    assert not (project / "runs" / ".staging" / "results").exists()
    previous = list((project / "runs").glob("previous-results-*"))
    assert len(previous) == 1 and (previous[0] / "committed.txt").is_file()
    readme = (results / "README.md").read_text()
    assert readme.startswith("# Results of `make reproduce`")
    assert "--methods full,snapkv,ripplekv" in readme and "\\," not in readme
    assert ".staging" not in readme and "--out results/eval" in readme


@pytest.mark.slow
def test_the_context_only_protocol_runs_after_eval_and_the_page_states_the_headline(project):
    config = project / "configs" / "reproduce.env"
    config.write_text(CONFIG + CONTEXT)
    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    results = project / "results"
    assert (results / "eval-context-only" / "leaderboard.csv").is_file()
    readme = (results / "README.md").read_text()
    assert "--protocol context-only" in readme and "--out results/eval-context-only" in readme
    assert "## Headline, with-question protocol" in readme and "## Context-only protocol" in readme
    # criticalkv is closest (KL 0.4), the runner-up snapkv (0.5); their difference's interval holds 0: a tie, said so.
    assert "`criticalkv` 0.400" in readme and "`snapkv` 0.500" in readme and "-0.100 [-0.200, +0.050]" in readme
    assert "| tied " in readme and "Tied at B=128" in readme and "ceiling" not in readme and "gap closed" not in readme
    assert "-0.100 [-0.200, -0.050] closer" in readme and "2 samples" in readme  # against snapkv, from the leaderboard
    assert "Informative tasks" in readme and "code (full cache 1.50, best constant answer 40.00)" in readme


def test_the_memory_axis_runs_only_when_configured_and_the_page_names_the_best_way_per_budget(project):
    """MEMORY_METHODS's eval into OUT/eval-memory; the page gives its headline (closest way of spending each
    budget's bytes against the runner-up, tied when their interval holds 0) and the memory-axis table."""
    config = project / "configs" / "reproduce.env"
    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    assert not (project / "results" / "eval-memory").exists() and "Memory axis" not in (project / "results" / "README.md").read_text()
    config.write_text(CONFIG + MEMORY)
    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    readme = (project / "results" / "README.md").read_text()
    assert "--out results/eval-memory" in readme and "--methods full,snapkv,ripplekv,kivi:bits=4,snapkv:quant=kivi:bits=4" in readme
    section = readme[readme.index("## Memory axis: the best way found"):]
    assert "`criticalkv` 0.400" in section and "| tied " in section and "| 128 | snapkv:quant=kivi:bits=4 | 4 |" in section
    assert "![memory axis](eval-memory/memory_axis.png)" in section


LONG = """LONG_TASKS=paragraph_recall
LONG_METHODS=full,snapkv,ripplekv
LONG_BUDGETS="64"
LONG_LIMIT=1
LONG_TARGET_TOKENS=2000
"""


@pytest.mark.slow
def test_the_long_answer_section_runs_both_decode_budgets_only_when_configured(project):
    config = project / "configs" / "reproduce.env"
    config.write_text(CONFIG + LONG)
    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    results = project / "results"
    assert (results / "long" / "prompt" / "predictions.jsonl").is_file()
    readme = (results / "README.md").read_text()
    assert "## Long answers under decode budgets" in readme
    assert "--tasks paragraph_recall --budget 64 --methods full,snapkv,ripplekv" in readme
    assert "--decode-budget prompt --out results/long/prompt" in readme and "--decode-budget total" in readme
    # snapkv at B=64: prompt mode peaks at 64 + 100 fed tokens; total holds 64.
    snap = next(line for line in readme.splitlines() if line.startswith("| snapkv"))
    assert [cell.strip() for cell in snap.strip("|").split("|")] == \
        ["snapkv", "64", "1", "50", "0.1", "101", "164", "50", "0.1", "101", "64"]
    config.write_text(CONFIG)
    shutil.rmtree(results)
    again = reproduce(project)
    assert again.returncode == 0, again.stderr
    assert not (results / "long").exists() and "Long answers" not in (results / "README.md").read_text()



DRAWS = """DRAWS=3
DRAW_BUDGETS="64"
RATIOS="2 4"
TUNE="cake:tau1=0.5,1"
METHODS=full,snapkv,ripplekv,depthkv:scorer=snapkv,routed,cake
"""


def test_calibration_draws_calibrate_every_method_per_draw_and_the_page_gives_the_spread(project):
    config = project / "configs" / "reproduce.env"
    config.write_text(CONFIG + OPTIONAL_STAGES + DRAWS)
    failed = reproduce(project, fail_at="eval")  # interrupted after every draw's calibration
    assert failed.returncode != 0
    staging = project / "runs" / ".staging" / "results"
    for d in (1, 2):
        assert (staging / "draws" / f"d{d}" / f"allocation-d{d}.csv").is_file()
        assert (staging / "draws" / f"d{d}" / f"depthkv-d{d}.csv").is_file()
        assert (staging / "draws" / f"d{d}" / f"ROUTE-d{d}.csv").is_file()
    assert "--calib-draw 2 --calib-draws 3" in (staging / ".profile-d2.cmd").read_text()
    assert "--placements 0" in (staging / ".route-d1.cmd").read_text()  # the placement study is draw 0's
    # Predictors pool the three draws' profiles (the record is `printf %q`'s, commas escaped).
    assert "results/profile-evict,results/draws/d1/profile-evict,results/draws/d2/profile-evict" in \
        (staging / ".predictors.cmd").read_text().replace("\\,", ",")

    done = reproduce(project)
    assert done.returncode == 0, done.stderr
    assert "profile-d2: up to date" in done.stdout and "route-d1: up to date" in done.stdout
    results = project / "results"
    draws = (results / "draws.csv").read_text().splitlines()
    assert draws[0] == "method,draw,variant" and len(draws) == 1 + 3 * 3  # ripplekv, depthkv, routed x 3 draws
    assert "ripplekv,1,ripplekv:allocation=allocation-d1.csv" in draws
    assert "routed,2,routed:route=ROUTE-d2.csv" in draws
    assert "depthkv:allocation=depthkv.csv:scorer=snapkv,2,depthkv:allocation=depthkv-d2.csv:scorer=snapkv" in draws
    readme = (results / "README.md").read_text()
    # The tuned baseline is evaluated as tuned; the draws' eval runs at DRAW_BUDGETS beside draw 0's.
    assert "--methods full,snapkv,ripplekv,depthkv:allocation=results/depthkv.csv:scorer=snapkv,routed,cake:tau1=2" in readme
    assert "--budget 64 --methods full,ripplekv:allocation=results/draws/d1/allocation-d1.csv," in readme
    assert "## Calibration draws" in readme and "## Baselines tuned on calibration prompts" in readme
    spread = (results / "calibration_spread.csv").read_text().splitlines()
    assert len(spread) == 1 + 3 and all(",64,3,3," in line for line in spread[1:])  # 3 methods at B=64, 3 draws, 3 samples
    assert "draw 0 **4** of {2, 4, 8, 16} (grid extended 2x past its edge); draw 1 **8**" in readme
    assert "draw 1 agrees on 1 of 2 layers (chance 1.0)" in readme  # snapkv,h2o vs snapkv,snapkv
    assert "draw 0: 1 vs 1 prompts agree on 1 of 2 layers (chance 1.0)" in readme


@pytest.mark.slow
def test_the_second_model_runs_into_its_folder_and_the_bundled_models_run_keeps_it(project):
    """`make reproduce-gemma` (configs/gemma3.env) builds results/gemma3 with its own profile, allocation, eval and
    page; `make reproduce` (CARRY=gemma3) then replaces what it made, keeps results/gemma3 as it was, and its page
    pairs the two models' rankings, ties called ties."""
    (project / "configs" / "gemma3.env").write_text(GEMMA)
    done = subprocess.run(["bash", "scripts/reproduce.sh", "configs/gemma3.env"], cwd=project, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results, gemma = project / "results", project / "results" / "gemma3"
    assert (gemma / "profile" / "sensitivity.csv").is_file() and (gemma / "eval" / "leaderboard.csv").is_file()
    page = (gemma / "README.md").read_text()
    assert page.startswith("# Results of `make reproduce-gemma`") and "--out results/gemma3/eval" in page
    assert (results / "committed.txt").is_file()  # the second model's run leaves the rest of results/ alone

    (gemma / "eval" / "marker").write_text("made by reproduce-gemma")
    (project / "configs" / "reproduce.env").write_text(CONFIG + "CARRY=gemma3\n")
    again = reproduce(project)
    assert again.returncode == 0, again.stderr
    assert "gemma3: kept from results" in again.stdout
    assert (gemma / "eval" / "marker").read_text() == "made by reproduce-gemma"
    assert not (results / "committed.txt").exists() and (results / "eval" / "leaderboard.csv").is_file()
    readme = (results / "README.md").read_text()
    assert "## Second model: `gemma3`" in readme and "allocation. Its sliding-window layers" in readme
    # The stand-in's KL differences are the same on every sample: 3 samples cannot reject, so both models tie,
    # at each of the two budgets they share.
    assert "| ripplekv vs snapkv |" in readme and "undecided (tied on m and gemma3)" in readme and "2 undecided." in readme


CHANGES = [
    ("TASKS=niah,nope", "TASKS (the eval stage): unknown task 'nope'"),
    ("METHODS=full,snapkv,nope", "unknown method 'nope'"),
    ("COMPARE_METHODS=full,snapkv,nosuch", "COMPARE_METHODS (the eval-compare stage"),
    ("MEMORY_METHODS=full,ripplekv,snapkv:quant=kivi:bits=3", "MEMORY_METHODS (the eval-memory stage"),
    ("METHODS=full,snapkv,ripplekv,compresskv", "set COMPRESSKV_CALIB_SAMPLES"),
    ("HEADLINE_METHODS=full,h2o,depthkv", "set EVICT_CALIB_SAMPLES"),
    ("BUDGETS=64 0", "BUDGETS='64 0': budget must be a positive integer"),
    ("LIMIT=0", "LIMIT='0' must be an integer >= 1"),
    ("METHODS=full,gracekv:slots=fixed:shape=2,ripplekv", "option shape changes nothing here"),
    ("CONTEXT_METHODS=full,snapkv\nCONTEXT_BUDGETS=128\nCONTEXT_LIMIT=1", "--allocation applies to none"),
    ("ROUTE_CALIB_SAMPLES=2\nROUTE_BUDGET=128\nPLACEMENTS=5\nPLACEMENT_SAMPLES=0", "leaves no prompts to score"),
    ("RATIOS=\"2 0.5\"", "RATIOS='2 0.5': '0.5' is not a ratio >= 1"),
    ("CARRY=gemma3/eval", "CARRY='gemma3/eval': 'gemma3/eval' is not a folder name inside OUT"),
]


def preflight(text: str, monkeypatch) -> int:
    """scripts/check_config.py's exit status, as reproduce.sh runs it with the config's settings in the environment."""
    from tests.conftest import load_script

    check = load_script("check_config")
    settings = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    optional = (line.split("=", 1)[0] for line in ALL_SETTINGS.splitlines() if "=" in line)
    for name in [*check.REQUIRED, *check.COUNTS, "TASKS", "COMPARE_METHODS", "CARRY", *optional]:
        monkeypatch.delenv(name, raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value.strip('"'))
    monkeypatch.setattr(sys, "argv", ["check_config.py", "configs/reproduce.env"])
    return check.main()


@pytest.mark.parametrize("change, message", CHANGES)
def test_the_preflight_names_each_mistake_in_one_line(change, message, monkeypatch, capsys):
    assert preflight(CONFIG + change + "\n", monkeypatch) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: configs/reproduce.env: ") and message in lines[0], lines


CONTEXT = 'CONTEXT_METHODS=full,snapkv,ripplekv,criticalkv,oracle\nCONTEXT_BUDGETS="128"\nCONTEXT_LIMIT=2\n'
MEMORY = 'MEMORY_METHODS=full,snapkv,ripplekv,kivi:bits=4,snapkv:quant=kivi:bits=4\nMEMORY_BUDGETS="128"\nMEMORY_LIMIT=2\n'
STAND_IN_CONFIGS = {"plain": CONFIG, "optional stages": CONFIG + OPTIONAL_STAGES, "context": CONFIG + CONTEXT,
                    "memory": CONFIG + MEMORY, "long": CONFIG + LONG, "draws": CONFIG + OPTIONAL_STAGES + DRAWS,
                    "gemma": GEMMA, "carry": CONFIG + "CARRY=gemma3\n"}
ALL_SETTINGS = OPTIONAL_STAGES + CONTEXT + MEMORY + LONG + DRAWS


@pytest.mark.parametrize("name", STAND_IN_CONFIGS)
def test_the_preflight_accepts_every_config_the_stand_in_runs_use(name, monkeypatch, capsys):
    """The stand-in runs skip the pre-flight: the real one passes each of their configs, so they run what it allows."""
    assert preflight(STAND_IN_CONFIGS[name], monkeypatch) == 0, capsys.readouterr().err


def test_reproduce_refuses_a_bad_config_before_any_stage(project_with_preflight):
    """A method whose input comes from a stage the config leaves off: one line, exit 2, before the first stage
    runs or anything is built (each mistake's line is checked in-process above)."""
    project, (change, message) = project_with_preflight, CHANGES[3]
    config = project / "configs" / "reproduce.env"
    config.write_text(CONFIG + change + "\n")
    done = reproduce(project)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: configs/reproduce.env: ") and message in lines[0], done.stderr
    assert "== profile" not in done.stdout and not (project / "runs").exists()
    assert sorted(p.name for p in (project / "results").iterdir()) == ["committed.txt"]
