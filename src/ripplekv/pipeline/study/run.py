"""`ripplekv study CONFIG` (`make study`): a controlled, powered comparison, resumable, on a `staged.StagedRun`.

screen (calibration prompts only: which model, suite, length and tasks can tell methods apart)
-> per draw: every calibrated allocation fitted on the same prompts
-> pilot (draw 0's fits on a few calibration prompts: the spread that sets n)
-> the factorial eval (allocation x scorer x head split, plus the extra rows) at n per task
-> the further draws' eval (every calibrated row once more per draw, on the first draws_limit samples)
-> the second model (its own RippleKV profile, second_methods at second_budgets)
-> the page (results/study/README.md).

The design is the config's, fixed before any of this runs; the screen's choice and n are computed by rules
the config and the page state. Each stage is the `ripplekv` command a user would type, in a subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from ripplekv.errors import UserError
from ripplekv.pipeline.draws import write_spread
from ripplekv.pipeline.staged import StagedRun
from ripplekv.pipeline.study import plan
from ripplekv.pipeline.study.config import StudyConfig, load_study_config

PILOT, EVAL, DRAWS_EVAL, SECOND = "pilot", "eval", "eval-draws", "second"
LINKED = ("predictions.jsonl", "informative.csv")  # the eval's files also reachable at the study's top
POWER_JSON, DRAWS_CSV, DESIGN_JSON = "power.json", "draws.csv", "design.json"


SITTINGS_CSV = "sittings.csv"


def source_commit() -> str:
    """The git commit of the code running the study (`+dirty` with uncommitted changes in it), or `unknown`
    outside a git checkout: a study spans sittings, and the code may change between them."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                               cwd=here.parents[2], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def record_sitting(out: str) -> None:
    """Append this sitting's start (UTC) and code commit to OUT/sittings.csv (the page lists them)."""
    from datetime import UTC, datetime

    path = Path(out) / SITTINGS_CSV
    if not path.is_file():
        path.write_text("started_utc,commit\n")
    with path.open("a") as handle:
        handle.write(f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')},{source_commit()}\n")


def labels(specs: list[str]) -> list[str]:
    """Each spec's eval label (what predictions.jsonl calls it)."""
    from ripplekv.methods import make_method

    return [make_method(spec).label for spec in specs]


def pair_cells(config: StudyConfig, files: dict[str, str]) -> list[tuple[str, str]]:
    """(first allocation's label, second's) per scorer x split cell: what the primary comparison averages."""
    first, second = config.pair
    return [tuple(labels([plan.cell_spec(allocation, scorer, split, files) for allocation in (first, second)]))
            for scorer in config.scorers for split in config.splits]


def write_power(run: StagedRun, config: StudyConfig, files: dict[str, str]) -> None:
    from ripplekv.analysis.report import load_predictions
    from ripplekv.analysis.study_power import required_limit
    from ripplekv.runs.safeio import write_json

    frame = load_predictions(run.path(PILOT))
    power = required_limit(frame, pair_cells(config, files), config.budgets, config.meaningful,
                           config.min_limit, config.max_limit)
    write_json(Path(run.path(POWER_JSON)), power)
    note = " (capped: the meaningful effect stays out of reach)" if power["capped"] else ""
    print(f"== power: n = {power['limit']} per task{note}", flush=True)


def calibrate(run: StagedRun, config: StudyConfig, choice: plan.Choice) -> None:
    for draw in range(config.draws):
        for stage in plan.calibration_stages(config, choice, run.out, draw):
            run.stage(stage.name, stage.marker, stage.command)
        for source, target in plan.curve_copies(config, run.out, draw):
            if source.is_file():
                shutil.copyfile(source, target)


def write_draws_table(run: StagedRun, config: StudyConfig) -> list[str]:
    """OUT/draws.csv (which label is which draw of which row) and the further draws' specs."""
    from ripplekv.runs.safeio import write_csv

    first = labels(plan.calibrated_specs(config, plan.fitted_files(config, run.out, 0)))
    rows, further = [{"method": m, "draw": 0, "variant": m} for m in first], []
    for draw in range(1, config.draws):
        specs = plan.calibrated_specs(config, plan.fitted_files(config, run.out, draw))
        further += specs
        rows += [{"method": m, "draw": draw, "variant": v} for m, v in zip(first, labels(specs))]
    write_csv(Path(run.path(DRAWS_CSV)), pd.DataFrame(rows, columns=["method", "draw", "variant"]))
    return further


def second_model(run: StagedRun, config: StudyConfig, other: plan.Choice) -> None:
    """The other screened model: its own RippleKV profile and ratio (on its own tasks' calibration split), then
    second_methods at its budgets."""
    folder, fitted = run.path(SECOND), run.path(f"{SECOND}-calibration")  # an eval's folder holds the eval alone
    same = ["--model", other.model, "--calib-tasks", other.calib_tasks, "--calib-samples", str(config.calib_samples),
            "--target-tokens", str(other.target_tokens)]
    allocation = f"{fitted}/allocation-{SECOND}.csv"
    for stage in plan.sensitivity_stages(config, fitted, f"-{SECOND}", same, allocation):
        run.stage(stage.name, stage.marker, stage.command)
    methods = [f"{name}:allocation={allocation}" if name == plan.ALLOCATION_FITTED else name
               for name in config.second_methods]
    run.always("eval-second", f"the second model ({other.model})",
               plan.eval_command(other, methods, config.second_budgets, config.second_limit, folder))


def write_design(run: StagedRun, config: StudyConfig, choice: plan.Choice, other: plan.Choice | None) -> None:
    """OUT/design.json: the cells of every grid row (from the eval's resolved methods), the pair and the choices."""
    from ripplekv.methods.factors import REFERENCE_ALLOCATION, design
    from ripplekv.runs.safeio import write_json

    specs = json.loads(Path(run.path(EVAL, "config.json")).read_text(encoding="utf-8"))["method_specs"]
    write_json(Path(run.path(DESIGN_JSON)), {
        "cells": [dict(zip(("method", "allocation", "scorer", "split"), row)) for row in design(specs)],
        "pair": list(config.pair), "reference": REFERENCE_ALLOCATION, "meaningful": config.meaningful, "budgets": list(config.budgets),
        "model": choice.model, "suite": choice.suite, "target_tokens": choice.target_tokens,
        "tasks": list(choice.tasks), "max_tasks": config.max_tasks, "second_model": other.model if other else None, "config": config.path})


def check_methods(config: StudyConfig) -> None:
    """Every scorer, split and uncalibrated row built once (a typo is one line now, not hours in)."""
    from ripplekv.methods import make_method

    fixed = [name for name in config.allocations if name not in plan.STUDY_CALIBRATED]
    for allocation in fixed[:1]:
        for scorer in config.scorers:
            for split in config.splits:
                make_method(f"{allocation}:scorer={scorer}:split={split}")
    for name in (*fixed, *config.extra_methods, *config.second_methods):
        if name not in plan.STUDY_CALIBRATED:
            make_method(name)


def study(config_path: str, check_only: bool = False, page_only: bool = False) -> None:
    """Run (or resume) the study of `config_path` into its `out` (see the module docstring)."""
    from ripplekv.analysis.study_report import write_study_page

    config = load_study_config(config_path)
    check_methods(config)
    print(f"== pre-flight: {config_path} checked (every setting, scorer, split and row)", flush=True)
    if check_only:
        return
    if page_only:
        if not (Path(config.out) / DESIGN_JSON).is_file():
            raise UserError(f"{config.out} holds no finished study: run `ripplekv study {config_path}` first")
        write_study_page(Path(config.out), config.out)
        print(f"== {config.out}/README.md written", flush=True)
        return
    run = StagedRun(config.out)
    run.begin()
    record_sitting(run.out)
    screen = run.path("screen")
    run.stage("screen", f"{screen}/screen.choice.json", plan.screen_command(config, screen))
    choice, other = plan.read_choices(f"{screen}/screen.choice.json", config.max_tasks)
    print(f"== the screen chose {choice.model}, {choice.suite} at {choice.target_tokens} tokens: "
          f"{', '.join(choice.tasks)}", flush=True)
    calibrate(run, config, choice)
    files = plan.fitted_files(config, run.out, 0)
    pilot = [spec for pair in zip(*[[plan.cell_spec(a, s, p, files) for s in config.scorers for p in config.splits]
                                    for a in config.pair]) for spec in pair]
    run.always("pilot", "the pilot (calibration prompts: the spread that sets n)",
               plan.eval_command(choice, pilot, config.budgets, config.pilot_limit, run.path(PILOT), "calibration"))
    run.step("power", run.path(POWER_JSON), f"ripplekv.pipeline.study.run.write_power {run.path(PILOT)}",
             lambda: write_power(run, config, files))
    limit = json.loads(Path(run.path(POWER_JSON)).read_text())["limit"]
    methods = plan.grid_specs(config, files) + plan.extra_specs(config, files)
    run.always("eval", f"the factorial eval ({len(methods)} rows, {limit} samples a task)",
               plan.eval_command(choice, methods, config.budgets, limit, run.path(EVAL)))
    for name in LINKED:  # relative links: the study's predictions at its top, one copy in git
        link = Path(run.path(name))
        if not link.is_symlink():
            link.symlink_to(f"{EVAL}/{name}")
    further = write_draws_table(run, config)
    if further:
        run.always(DRAWS_EVAL, f"the further draws ({config.draws - 1}) on {config.draws_limit} samples a task",
                   plan.eval_command(choice, further, config.budgets, config.draws_limit, run.path(DRAWS_EVAL)))
        write_spread(Path(run.out))
    if other is not None:
        second_model(run, config, other)
    write_design(run, config, choice, other)
    write_study_page(Path(run.out), run.final)
    run.finish()
