"""`ripplekv reproduce` with a stand-in `ripplekv` for its stages: OUT is replaced only when every stage succeeded;
the pre-flight refuses a bad config in one line; the committed config builds the committed commands."""

from __future__ import annotations

import json
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from ripplekv.pipeline.reproduce import run as run_module
from ripplekv.pipeline.staged import StageFailed

REPO = Path(__file__).resolve().parents[1]

# Writes what each stage's real command writes (enough for the results page); fails at $FAIL_AT.
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
elif "--protocol" in args and args[args.index("--protocol") + 1].startswith("multi-question"):
    out.mkdir(parents=True, exist_ok=True)  # 12 contexts, 3 questions: each method's follow-ups further by 0.05 x index
    specs = args[args.index("--methods") + 1].split(",")
    budgets = [int(args[i + 1]) for i, a in enumerate(args) if a == "--budget"]
    lines = [json.dumps({"id": f"c{c}#q{q}", "context_id": f"c{c}", "question_index": q, "task": "niah_multiquestion",
                         "category": "Synthetic", "method": spec, "budget": budget, "score": 1.0, "agreement": 1.0,
                         "prompt_tokens": 1100 + c, "kl": 0.0 if spec == "full" else
                         0.1 * index + 0.01 * c + (0.05 * index if q > 1 else 0.0)})
             for c in range(12) for q in (1, 2, 3) for index, spec in enumerate(specs)
             for budget in ([None] if spec == "full" else budgets)]
    (out / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    (out / "config.json").write_text(json.dumps({"model_label": "m", "samples": {"niah_multiquestion": ["c0"]}}))
    (out / "follow_ups.md").write_text("## Follow-up questions\n")
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

# The stand-in runs' settings, written as TOML by `toml` (a later dict's keys replace an earlier one's).
CONFIG = {"model": "", "out": "results", "calib_samples": 2, "seeds": 1, "eta": 0.3, "probe_tokens": 16,
          "ratios": [4], "sweep_samples": 2, "sweep_budget": 128, "suite": "offline", "budgets": [64, 128],
          "methods": ["full", "snapkv", "ripplekv"], "limit": 1, "target_tokens": 2000}
OPTIONAL_STAGES = {"evict_calib_samples": 2, "route_calib_samples": 2, "route_budget": 128, "placements": 3,
                   "placement_samples": 1, "methods": ["full", "snapkv", "ripplekv", "depthkv", "routed"],
                   "headline_methods": ["full", "h2o", "depthkv"], "depthkv_floor": 0.25}
CONTEXT = {"context_methods": ["full", "snapkv", "ripplekv", "criticalkv", "oracle"], "context_budgets": [128],
           "context_limit": 2}
MEMORY = {"memory_methods": ["full", "snapkv", "ripplekv", "kivi:bits=4", "snapkv:quant=kivi:bits=4"],
          "memory_budgets": [128], "memory_limit": 2}
LONG = {"long_tasks": ["paragraph_recall"], "long_methods": ["full", "snapkv", "ripplekv"], "long_budgets": [64],
        "long_limit": 1, "long_target_tokens": 2000}
DRAWS = {"draws": 3, "draw_budgets": [64], "ratios": [2, 4], "tune": ["cake:tau1=0.5,1"],
         "methods": ["full", "snapkv", "ripplekv", "depthkv:scorer=snapkv", "routed", "cake"]}
MULTI = {"multi_methods": ["full", "snapkv", "streamingllm", "ripplekv"], "multi_tasks": ["niah_multiquestion"],
         "multi_budgets": [128], "multi_limit": 2}
# configs/gemma3.toml's shape: the second model's own run into a folder of results/ (the bundled model stands in for
# Gemma here: the stand-in ripplekv ignores --model, and the pre-flight need not assemble Gemma's GGUF)
GEMMA = {**CONFIG, "out": "results/gemma3"}


def toml(*settings: dict) -> str:
    """The settings as a config file (TOML), later dicts overriding earlier ones."""
    merged = {key: value for part in settings for key, value in part.items()}
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in merged.items())


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A folder with configs/reproduce.toml, a committed results/ and the stand-in ripplekv as every stage's
    program; the working directory while the test runs. The pre-flight is skipped (it imports the model's config:
    seconds a run); the real one passes every config used here (test_the_preflight_accepts_...)."""
    fake = tmp_path / "fake-ripplekv"
    fake.write_text(FAKE_RIPPLEKV.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("RIPPLEKV_PROGRAM", str(fake))
    monkeypatch.delenv("FAIL_AT", raising=False)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "reproduce.toml").write_text(toml(CONFIG))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "committed.txt").write_text("the committed results\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_module, "check_config", lambda config: None)
    return tmp_path


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def ripplekv(args: list[str], capfd, monkeypatch, fail_at: str | None = None) -> Done:
    """`ripplekv ARGS` in this process (its stages as subprocesses), with FAIL_AT for the stand-in."""
    from ripplekv.cli.app import main

    monkeypatch.setenv("FAIL_AT", fail_at or "")
    monkeypatch.setattr(sys, "argv", ["ripplekv", *args])
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        main()
    out, err = capfd.readouterr()
    return Done(stop.value.code or 0, out, err)


def reproduce(capfd, monkeypatch, fail_at: str | None = None, config: str = "configs/reproduce.toml") -> Done:
    return ripplekv(["reproduce", config], capfd, monkeypatch, fail_at)


def write_config(project: Path, *settings: dict) -> None:
    (project / "configs" / "reproduce.toml").write_text(toml(*settings))


@pytest.mark.slow
def test_depthkv_and_route_stages_feed_eval_and_the_results_page(project, capfd, monkeypatch):
    write_config(project, CONFIG, OPTIONAL_STAGES)
    done = reproduce(capfd, monkeypatch)
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
    write_config(project, CONFIG)
    shutil.rmtree(results)
    again = reproduce(capfd, monkeypatch)
    assert again.returncode == 0, again.stderr
    readme = (results / "README.md").read_text()
    assert "--route" not in readme and "depthkv" not in readme.lower() and "## Layer-wise routing" not in readme


@pytest.mark.slow
def test_a_failed_run_leaves_results_untouched_and_the_next_one_resumes_and_replaces_them(project, capfd, monkeypatch):
    failed = reproduce(capfd, monkeypatch, fail_at="eval")
    assert failed.returncode == 1 and "== eval failed (exit 1); finished stages are kept" in failed.stdout
    assert sorted(p.name for p in (project / "results").iterdir()) == ["committed.txt"]
    assert (project / "runs" / ".staging" / "results" / "profile" / "sensitivity.csv").is_file()

    done = reproduce(capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    assert "profile: up to date" in done.stdout and "allocate: up to date" in done.stdout
    results = project / "results"
    assert (results / "eval" / "predictions.jsonl").is_file() and not (results / "committed.txt").exists()
    assert not (project / "runs" / ".staging" / "results").exists()
    previous = list((project / "runs").glob("previous-results-*"))
    assert len(previous) == 1 and (previous[0] / "committed.txt").is_file()
    readme = (results / "README.md").read_text()
    assert readme.startswith("# Results of `make reproduce`")
    assert "Produced by `ripplekv reproduce configs/reproduce.toml` into `results`" in readme
    assert "--methods full,snapkv,ripplekv" in readme and "\\," not in readme
    assert ".staging" not in readme and "--out results/eval" in readme
    stages = (results / "stages.csv").read_text().splitlines()  # the resumed run appended its stages
    assert stages[0] == "stage,seconds" and [line.split(",")[0] for line in stages[1:]] == \
        ["profile", "allocate", "eval"]


def test_a_changed_setting_reruns_its_stage_and_a_finished_one_is_skipped(project, capfd, monkeypatch):
    """A stage is skipped only when its output exists and its recorded command is the one wanted now."""
    assert reproduce(capfd, monkeypatch, fail_at="eval").returncode == 1
    write_config(project, CONFIG, {"ratios": [2, 4]})
    done = reproduce(capfd, monkeypatch, fail_at="eval")
    assert "== profile: up to date" in done.stdout and "== allocate: up to date" not in done.stdout
    assert "--ratio 2 --ratio 4" in (project / "runs" / ".staging" / "results" / ".allocate.cmd").read_text()


def test_records_of_the_bash_runner_count_as_up_to_date(tmp_path, monkeypatch, capsys):
    """A staging folder the earlier bash runner left (`printf %q` records, commas escaped, `.venv/bin/ripplekv`)
    resumes without rerunning its finished stages; a different command does rerun."""
    from ripplekv.pipeline.staged import StagedRun, ripplekv_command

    monkeypatch.chdir(tmp_path)
    run = StagedRun("results")
    run.begin()
    Path(run.path("marker")).write_text("x")
    Path(run.path(".eval.cmd")).write_text(".venv/bin/ripplekv eval --methods full\\,snapkv --out results/eval \n")
    monkeypatch.setenv("RIPPLEKV_PROGRAM", "false")  # would fail if run
    run.stage("eval", run.path("marker"), ripplekv_command("eval", "--methods", "full,snapkv", "--out", run.path("eval")))
    assert "== eval: up to date" in capsys.readouterr().out
    with pytest.raises(StageFailed):
        run.stage("eval", run.path("marker"), ripplekv_command("eval", "--methods", "full", "--out", run.path("eval")))


def test_finishing_points_each_config_at_the_files_in_the_output(tmp_path, monkeypatch):
    """An eval's config.json names the allocation it read inside the staging folder (relative or absolute, as it
    was given); once that folder becomes the output the record names the output's file, other paths untouched."""
    import json

    from ripplekv.pipeline.staged import StagedRun

    monkeypatch.chdir(tmp_path)
    run = StagedRun("results")
    run.begin()
    Path(run.path("eval")).mkdir()
    absolute = str(tmp_path / run.path("route.csv"))
    recorded = {"allocation": run.path("allocation.csv"), "route": absolute, "curve": "/elsewhere/runs/.staging/x.csv"}
    Path(run.path("eval", "config.json")).write_text(json.dumps(recorded))
    run.finish()
    config = json.loads((tmp_path / "results" / "eval" / "config.json").read_text())
    assert config == {"allocation": "results/allocation.csv", "route": "results/route.csv",
                      "curve": "/elsewhere/runs/.staging/x.csv"}
@pytest.mark.slow
def test_the_context_only_protocol_runs_after_eval_and_the_page_states_the_headline(project, capfd, monkeypatch):
    write_config(project, CONFIG, CONTEXT)
    done = reproduce(capfd, monkeypatch)
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


def test_the_memory_axis_runs_only_when_configured_and_the_page_names_the_best_way_per_budget(project, capfd,
                                                                                            monkeypatch):
    """memory_methods' eval into OUT/eval-memory; the page gives its headline (closest way of spending each
    budget's bytes against the runner-up, tied when their interval holds 0) and the memory-axis table."""
    done = reproduce(capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    readme = (project / "results" / "README.md").read_text()
    assert not (project / "results" / "eval-memory").exists() and "Memory axis" not in readme
    write_config(project, CONFIG, MEMORY)
    done = reproduce(capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    readme = (project / "results" / "README.md").read_text()
    assert "--out results/eval-memory" in readme
    assert "--methods full,snapkv,ripplekv,kivi:bits=4,snapkv:quant=kivi:bits=4" in readme
    section = readme[readme.index("## Memory axis: the best way found"):]
    assert "`criticalkv` 0.400" in section and "| tied " in section and "| 128 | snapkv:quant=kivi:bits=4 | 4 |" in section
    assert "![memory axis](eval-memory/memory_axis.png)" in section


def test_the_multi_question_protocols_run_both_variants_and_their_page_names_whose_follow_ups_hold_best(
        project, capfd, monkeypatch):
    """multi_methods' two evals (question-agnostic, first question in the window) into OUT/multi-question; its page
    names per variant and budget the best-holding method against the runner-up, and the results page links it."""
    write_config(project, CONFIG, MULTI)
    done = reproduce(capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    folder = project / "results" / "multi-question"
    assert (folder / "question-agnostic" / "predictions.jsonl").is_file()
    assert (folder / "first-question" / "predictions.jsonl").is_file()
    page = (folder / "README.md").read_text()
    for protocol, name in (("multi-question", "question-agnostic"), ("multi-question-first", "first-question")):
        recorded = (project / "results" / f".eval-{protocol}.cmd").read_text().strip()
        assert f"--protocol {protocol} " in recorded and f"--out results/multi-question/{name}" in recorded
        assert recorded in page  # the page's commands are the ones the run recorded
    assert "--tasks niah_multiquestion" in page and "--allocation results/allocation.csv" in page
    assert "niah_multiquestion 12 contexts, 3 questions each" in page and "prompts of 1100-1111 tokens" in page
    table = pd.read_csv(folder / "holding.csv")
    assert list(table["variant"]) == ["question-agnostic", "first question in the window"]
    assert set(table["best"]) == {"snapkv"} and set(table["runner_up"]) == {"streamingllm"}
    assert table["in_sample"].tolist() == pytest.approx([-0.15, -0.15]) and set(table["in_sample_verdict"]) == {"closer"}
    assert set(table["held_out_pairs"]) == {"snapkv vs streamingllm; snapkv vs streamingllm"}
    assert table["runner_up_drop"].tolist() == pytest.approx([0.1, 0.1])
    assert "`snapkv` 0.1" in page and "`streamingllm` 0.3" in page and "| closer " in page
    readme = (project / "results" / "README.md").read_text()
    assert "[`multi-question/README.md`](multi-question/README.md)" in readme


@pytest.mark.slow
def test_the_long_answer_section_runs_both_decode_budgets_only_when_configured(project, capfd, monkeypatch):
    write_config(project, CONFIG, LONG)
    done = reproduce(capfd, monkeypatch)
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
    write_config(project, CONFIG)
    shutil.rmtree(results)
    again = reproduce(capfd, monkeypatch)
    assert again.returncode == 0, again.stderr
    assert not (results / "long").exists() and "Long answers" not in (results / "README.md").read_text()


def test_calibration_draws_calibrate_every_method_per_draw_and_the_page_gives_the_spread(project, capfd, monkeypatch):
    write_config(project, CONFIG, OPTIONAL_STAGES, DRAWS)
    failed = reproduce(capfd, monkeypatch, fail_at="eval")  # interrupted after every draw's calibration
    assert failed.returncode != 0
    staging = project / "runs" / ".staging" / "results"
    for d in (1, 2):
        assert (staging / "draws" / f"d{d}" / f"allocation-d{d}.csv").is_file()
        assert (staging / "draws" / f"d{d}" / f"depthkv-d{d}.csv").is_file()
        assert (staging / "draws" / f"d{d}" / f"ROUTE-d{d}.csv").is_file()
    assert "--calib-draw 2 --calib-draws 3" in (staging / ".profile-d2.cmd").read_text()
    assert "--placements 0" in (staging / ".route-d1.cmd").read_text()  # the placement study is draw 0's
    # Predictors pool the three draws' profiles.
    assert "results/profile-evict,results/draws/d1/profile-evict,results/draws/d2/profile-evict" in \
        (staging / ".predictors.cmd").read_text()

    done = reproduce(capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    assert "profile-d2: up to date" in done.stdout and "route-d1: up to date" in done.stdout
    assert "predictors: up to date" in done.stdout
    results = project / "results"
    draws = (results / "draws.csv").read_text().splitlines()
    assert draws[0] == "method,draw,variant" and len(draws) == 1 + 3 * 3  # ripplekv, depthkv, routed x 3 draws
    assert "ripplekv,1,ripplekv:allocation=allocation-d1.csv" in draws
    assert "routed,2,routed:route=ROUTE-d2.csv" in draws
    assert "depthkv:allocation=depthkv.csv:scorer=snapkv,2,depthkv:allocation=depthkv-d2.csv:scorer=snapkv" in draws
    readme = (results / "README.md").read_text()
    # The tuned baseline is evaluated as tuned; the draws' eval runs at draw_budgets beside draw 0's.
    assert "--methods full,snapkv,ripplekv,depthkv:allocation=results/depthkv.csv:scorer=snapkv,routed,cake:tau1=2" in readme
    assert "--budget 64 --methods full,ripplekv:allocation=results/draws/d1/allocation-d1.csv," in readme
    assert "## Calibration draws" in readme and "## Baselines tuned on calibration prompts" in readme
    spread = (results / "calibration_spread.csv").read_text().splitlines()
    assert len(spread) == 1 + 3 and all(",64,3,3," in line for line in spread[1:])  # 3 methods at B=64, 3 draws, 3 samples
    assert "draw 0 **4** of {2, 4, 8, 16} (grid extended 2x past its edge); draw 1 **8**" in readme
    assert "draw 1 agrees on 1 of 2 layers (chance 1.0)" in readme  # snapkv,h2o vs snapkv,snapkv
    assert "draw 0: 1 vs 1 prompts agree on 1 of 2 layers (chance 1.0)" in readme


@pytest.mark.slow
def test_the_second_model_runs_into_its_folder_and_the_bundled_models_run_keeps_it(project, capfd, monkeypatch):
    """`make reproduce-gemma` (configs/gemma3.toml) builds results/gemma3 with its own profile, allocation, eval and
    page; `make reproduce` (carry = ["gemma3"]) then replaces what it made, keeps results/gemma3 as it was, and its
    page pairs the two models' rankings, ties called ties."""
    (project / "configs" / "gemma3.toml").write_text(toml(GEMMA))
    done = reproduce(capfd, monkeypatch, config="configs/gemma3.toml")
    assert done.returncode == 0, done.stderr
    results, gemma = project / "results", project / "results" / "gemma3"
    assert (gemma / "profile" / "sensitivity.csv").is_file() and (gemma / "eval" / "leaderboard.csv").is_file()
    page = (gemma / "README.md").read_text()
    assert page.startswith("# Results of `make reproduce-gemma`") and "--out results/gemma3/eval" in page
    assert (results / "committed.txt").is_file()  # the second model's run leaves the rest of results/ alone

    (gemma / "eval" / "marker").write_text("made by reproduce-gemma")
    write_config(project, CONFIG, {"carry": ["gemma3"]})
    again = reproduce(capfd, monkeypatch)
    assert again.returncode == 0, again.stderr
    assert "gemma3: kept from results" in again.stdout
    assert (gemma / "eval" / "marker").read_text() == "made by reproduce-gemma"
    assert not (results / "committed.txt").exists() and (results / "eval" / "leaderboard.csv").is_file()
    # the pipeline ends with the web pages: each run's, and results/index.html linking them (the second model's too)
    index = (results / "index.html").read_text()
    assert (results / "eval" / "index.html").is_file() and "eval/index.html" in index and "gemma3/eval" in index
    readme = (results / "README.md").read_text()
    assert "## Second model: `gemma3`" in readme and "allocation. Its sliding-window layers" in readme
    # The stand-in's KL differences are the same on every sample: 3 samples cannot reject, so both models tie,
    # at each of the two budgets they share.
    assert "| ripplekv vs snapkv |" in readme and "undecided (tied on m and tied on gemma3)" in readme and "2 undecided." in readme
    # --page-only writes the same page again from the finished folder (as `make reproduce-gemma` ends), no stage runs.
    (results / "README.md").unlink()
    paged = ripplekv(["reproduce", "configs/reproduce.toml", "--page-only"], capfd, monkeypatch)
    assert paged.returncode == 0 and "== profile" not in paged.stdout
    assert (results / "README.md").read_text() == readme


def test_page_only_refuses_a_folder_without_a_finished_run(project, capfd, monkeypatch):
    done = ripplekv(["reproduce", "configs/reproduce.toml", "--page-only"], capfd, monkeypatch)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: configs/reproduce.toml: results holds no finished run"), done.stderr


CHANGES = [
    ({"tasks": ["niah", "nope"]}, "tasks (the eval stage): unknown task 'nope'"),
    ({"methods": ["full", "snapkv", "nope"]}, "unknown method 'nope'"),
    ({"compare_methods": ["full", "snapkv", "nosuch"]}, "compare_methods (the eval-compare stage"),
    ({"memory_methods": ["full", "ripplekv", "snapkv:quant=kivi:bits=3"]}, "memory_methods (the eval-memory stage"),
    ({"methods": ["full", "snapkv", "ripplekv", "compresskv"]}, "set compresskv_calib_samples"),
    ({"headline_methods": ["full", "h2o", "depthkv"]}, "set evict_calib_samples"),
    ({"budgets": [64, 0]}, "budgets = [64, 0]: 0 is not a positive integer"),
    ({"limit": 0}, "limit = 0 must be an integer >= 1"),
    ({"limit": "12"}, "limit = '12' must be an integer >= 1"),
    ({"methods": ["full", "gracekv:slots=fixed:shape=2", "ripplekv"]}, "option shape changes nothing here"),
    (CONTEXT | {"context_methods": ["full", "snapkv"], "context_limit": 1}, "--allocation applies to none"),
    ({"route_calib_samples": 2, "route_budget": 128, "placements": 5, "placement_samples": 0},
     "leaves no prompts to score"),
    ({"route_calib_samples": 2}, "route_calib_samples runs a stage that needs route_budget; set it"),
    ({"ratios": [2, 0.5]}, "ratios = [2, 0.5]: 0.5 is not a ratio >= 1"),
    ({"carry": ["gemma3/eval"]}, "carry: 'gemma3/eval' is not a folder name inside out"),
    ({"limt": 3}, "unknown setting 'limt' (did you mean 'limit'?)"),
    ({"tune": ["cake:tau1=0.5, 1"]}, "tune = ['cake:tau1=0.5, 1'] must list grids in quotes, each without spaces"),
    ({"eta": 0}, "eta = 0 must be a number in (0, 100)"),
    (MULTI | {"multi_methods": ["full", "snapkv", "oracle"]}, "multi_methods (the eval-multi-question stage"),
    (MULTI | {"multi_tasks": ["niah"]}, "multi_tasks (the eval-multi-question stage): niah ask(s) one question"),
    ({"multi_methods": ["full", "snapkv"]}, "multi_methods runs a stage that needs multi_budgets, multi_limit"),
]


def preflight(text: str, tmp_path: Path, capfd, monkeypatch) -> Done:
    """`ripplekv reproduce configs/reproduce.toml --check-only` on `text`: the real pre-flight."""
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / "reproduce.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    return ripplekv(["reproduce", "configs/reproduce.toml", "--check-only"], capfd, monkeypatch)


@pytest.mark.parametrize("change, message", CHANGES)
def test_the_preflight_names_each_mistake_in_one_line(change, message, tmp_path, capfd, monkeypatch):
    done = preflight(toml(CONFIG, change), tmp_path, capfd, monkeypatch)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: configs/reproduce.toml: ") and message in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_a_config_that_is_not_toml_is_one_line(tmp_path, capfd, monkeypatch):
    done = preflight(toml(CONFIG) + "limit = = 2\n", tmp_path, capfd, monkeypatch)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not valid TOML" in done.stderr
    missing = ripplekv(["reproduce", "configs/nope.toml"], capfd, monkeypatch)
    assert missing.returncode == 2 and "configs/nope.toml: cannot read the config" in missing.stderr


STAND_IN_CONFIGS = {"plain": [CONFIG], "optional stages": [CONFIG, OPTIONAL_STAGES], "context": [CONFIG, CONTEXT],
                    "memory": [CONFIG, MEMORY], "long": [CONFIG, LONG], "draws": [CONFIG, OPTIONAL_STAGES, DRAWS],
                    "gemma": [GEMMA], "carry": [CONFIG, {"carry": ["gemma3"]}], "multi": [CONFIG, MULTI]}


@pytest.mark.parametrize("name", STAND_IN_CONFIGS)
def test_the_preflight_accepts_every_config_the_stand_in_runs_use(name, tmp_path, capfd, monkeypatch):
    """The stand-in runs skip the pre-flight: the real one passes each of their configs, so they run what it allows."""
    done = preflight(toml(*STAND_IN_CONFIGS[name]), tmp_path, capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    assert "== pre-flight: configs/reproduce.toml checked" in done.stdout


@pytest.mark.parametrize("name", ["quick", "reproduce", "full"])
def test_the_preflight_accepts_the_committed_configs(name, capfd, monkeypatch):
    monkeypatch.chdir(REPO)
    done = ripplekv(["reproduce", f"configs/{name}.toml", "--check-only"], capfd, monkeypatch)
    assert done.returncode == 0, done.stderr


def test_the_committed_config_builds_the_commands_results_records():
    """configs/reproduce.toml declares the very commands the committed results/ recorded (bash's `printf %q`
    records, compared word by word): the same stages, arguments and order, so a rerun reproduces results/."""
    from ripplekv.pipeline.reproduce.calibration import calibration_stages, tune_stage
    from ripplekv.pipeline.reproduce.checks import stage_files
    from ripplekv.pipeline.reproduce.config import load_config
    from ripplekv.pipeline.reproduce.evals import declared_evals, draws_eval, fed_lists
    from ripplekv.pipeline.staged import _words
    from ripplekv.pipeline.tune import apply_tuned, read_tuned

    results = REPO / "results"
    config = load_config(REPO / "configs" / "reproduce.toml")
    built = {}
    for draw in range(config.draw_count):
        for stage in calibration_stages(config, draw, "results" if draw == 0 else f"results/draws/d{draw}"):
            built[stage.name] = list(stage.command.shown)
    built["tune"] = list(tune_stage(config, "results").command.shown)
    methods, headline = fed_lists(config, stage_files(config, "results"))
    methods = apply_tuned(methods, read_tuned(results / "tune.json"))
    for spec in declared_evals(config, "results", methods, headline, "results/route/ROUTE.csv"):
        built[spec.name] = ["ripplekv", *spec.argv()]
    recorded_draws = _words((results / ".eval-draws.cmd").read_text())
    draw_methods = recorded_draws[recorded_draws.index("--methods") + 1].removeprefix("full,")
    built["eval-draws"] = ["ripplekv", *draws_eval(config, "results", draw_methods).argv()]
    recorded = {path.name[1:-4]: _words(path.read_text()) for path in results.glob(".*.cmd")}
    recorded.pop("predictors")  # a script then, a function of the package now
    assert set(built) == set(recorded) and len(recorded) == 33
    for name, words in recorded.items():
        assert built[name] == words, name


def test_the_predictors_step_refuses_an_output_under_a_file_in_one_line(tmp_path):
    from ripplekv.errors import UserError
    from ripplekv.pipeline.reproduce.run import write_predictors

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="a-file is a file, not a directory"):
        write_predictors(str(tmp_path / "drop"), [str(tmp_path / "kl")], str(tmp_path / "a-file" / "predictors.csv"))


@pytest.mark.parametrize("target", ["reproduce", "reproduce-quick", "reproduce-gemma", "reproduce-full"])
def test_every_make_target_runs_the_pipeline_on_a_config_that_loads(target):
    """Each `make reproduce*` target is `ripplekv reproduce` on a committed TOML config that parses."""
    import re
    import subprocess

    from ripplekv.pipeline.reproduce.config import load_config

    make = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=REPO, capture_output=True, text=True)
    configs = re.findall(r"ripplekv reproduce (configs/\S+\.toml)", make.stdout)
    assert configs, make.stdout
    for config in configs:
        assert load_config(REPO / config).out
