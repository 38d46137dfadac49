"""What a study runs, as data: the screen's command, each draw's calibration stages, the factorial's methods.

Every calibrated allocation is fitted in each draw on the *same* calibration prompts (the same `--calib-tasks`,
`--calib-samples`, `--calib-draw` of `--calib-draws`, `--target-tokens`): RippleKV's profile and ratio, LU-KV's
head-budget curves (one per scorer), CompressKV's layer-error profile. Draw d's fitted files are named `-dD`
(an eval label shows a file's name only), in OUT/calibration/dD/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ripplekv.defaults import PIPELINE_CURVES, STUDY_CALIBRATED
from ripplekv.errors import UserError
from ripplekv.pipeline.reproduce.calibration import Stage
from ripplekv.pipeline.reproduce.config import joined, text
from ripplekv.pipeline.staged import Command, ripplekv_command
from ripplekv.pipeline.study.config import StudyConfig

CURVE_OPTION = STUDY_CALIBRATED[PIPELINE_CURVES]
# the calibrated allocation read as a layer allocation (RippleKV's) and the one read as a layer-error profile
ALLOCATION_FITTED = next(name for name, option in STUDY_CALIBRATED.items() if option == "allocation")
PROFILE_FITTED = next(name for name, option in STUDY_CALIBRATED.items() if option == "profile")


@dataclass(frozen=True)
class Choice:
    """What the screen chose for one model: its suite, prompt length and tasks (bare names, widest margin first)."""

    model: str
    suite: str
    target_tokens: int
    tasks: tuple[str, ...]

    @property
    def calib_tasks(self) -> str:
        """`--calib-tasks`: offline tasks by name, another suite's as SUITE:TASK."""
        return ",".join(task if self.suite == "offline" else f"{self.suite}:{task}" for task in self.tasks)


def screen_command(config: StudyConfig, out: str) -> Command:
    suites = [word for suite in config.screen_suites for word in ("--suite", suite)]
    return ripplekv_command("screen", "--models", joined(config.screen_models), *suites, "--lengths",
                            joined(config.screen_lengths), "--limit", text(config.screen_limit), "--min-tasks",
                            text(config.min_tasks), "--out", out)


def read_choices(path: str | Path, max_tasks: int) -> tuple[Choice, Choice | None]:
    """(the study's model, the other model with at least one informative task or None) from screen.choice.json,
    each keeping its `max_tasks` widest-margin informative tasks (the screen lists them widest first)."""
    choice = json.loads(Path(path).read_text(encoding="utf-8"))

    def one(model: str, entry: dict) -> Choice:
        return Choice(model, entry["suite"], int(entry["target_tokens"]),
                      tuple(task.split(":", 1)[1] for task in entry["tasks"][:max_tasks]))

    main = one(choice["model"], choice)
    if not main.tasks:
        raise UserError(f"{path}: no model has an informative task at any screened length; the study has nothing "
                        "to judge on (screen longer or other tasks: screen_suites, screen_lengths)")
    others = [one(model, entry) for model, entry in choice["per_model"].items() if model != main.model and entry["tasks"]]
    return main, (others[0] if others else None)


def draw_folder(out: str, draw: int) -> str:
    return f"{out}/calibration/d{draw}"


def _calibration(config: StudyConfig, choice: Choice, draw: int) -> list[str]:
    return ["--model", choice.model, "--calib-tasks", choice.calib_tasks, "--calib-samples", text(config.calib_samples),
            "--calib-draw", str(draw), "--calib-draws", text(config.draws), "--target-tokens", text(choice.target_tokens)]


def curve_specs(config: StudyConfig) -> list[str]:
    """The LU-KV specs whose curves a draw fits: one per study scorer, and LU-KV's own when it is an extra row."""
    ours = [f"{PIPELINE_CURVES}:scorer={scorer}" for scorer in config.scorers]
    return ours + ([PIPELINE_CURVES] if PIPELINE_CURVES in config.extra_methods else [])


def curve_name(spec: str) -> str:
    """The scorer a curve file is named by (`lukv:scorer=snapkv` -> snapkv; `lukv` -> lukv)."""
    return spec.split(":scorer=", 1)[1].split(":", 1)[0] if ":scorer=" in spec else PIPELINE_CURVES


def fitted_files(config: StudyConfig, out: str, draw: int) -> dict[str, str]:
    """Draw `draw`'s fitted file of each calibrated allocation of the study; LU-KV's per scorer as `lukv@SCORER`."""
    folder, tag = draw_folder(out, draw), f"-d{draw}"
    files = {}
    for name, option in STUDY_CALIBRATED.items():
        if name not in config.allocations and name not in config.extra_methods:
            continue
        if option == CURVE_OPTION:
            for spec in curve_specs(config):
                files[f"{name}@{curve_name(spec)}"] = f"{folder}/curve-{curve_name(spec)}{tag}.csv"
        else:
            files[name] = f"{folder}/{name}{tag}.csv"
    return files


def sensitivity_stages(config: StudyConfig, folder: str, tag: str, calibration: list[str],
                       allocation: str | None) -> list[Stage]:
    """RippleKV's profile into FOLDER/profile and, given `allocation`, its allocation there (the ratio chosen among
    `ratios` on the same calibration prompts)."""
    sweep = ["--budget", text(config.sweep_budget)] if len(set(config.ratios)) > 1 else []
    ratios = [word for ratio in config.ratios for word in ("--ratio", text(ratio))]
    profile = Stage(f"profile{tag}", f"{folder}/profile/sensitivity.csv", ripplekv_command(
        "profile", *calibration, "--seeds", text(config.seeds), "--eta", text(config.eta), "--probe-tokens",
        text(config.probe_tokens), "--out", f"{folder}/profile"))
    if allocation is None:
        return [profile]
    return [profile, Stage(f"allocate{tag}", allocation, ripplekv_command(
        "allocate", f"{folder}/profile/sensitivity.csv", *calibration, *ratios, *sweep, "--out", allocation))]


def calibration_stages(config: StudyConfig, choice: Choice, out: str, draw: int) -> list[Stage]:
    """Draw `draw`'s stages: every calibrated allocation fitted on the same prompts."""
    folder, tag, same = draw_folder(out, draw), f"-d{draw}", _calibration(config, choice, draw)
    files = fitted_files(config, out, draw)
    stages = sensitivity_stages(config, folder, tag, same, files.get(ALLOCATION_FITTED))
    if any(key.startswith(f"{PIPELINE_CURVES}@") for key in files):
        specs = curve_specs(config)
        stages.append(Stage(f"fit-lukv{tag}", f"{folder}/lukv/curve-{curve_name(specs[-1])}.json", ripplekv_command(
            "fit", PIPELINE_CURVES, *same, "--methods", ",".join(specs), "--out", f"{folder}/lukv")))
    if PROFILE_FITTED in files:
        stages.append(Stage(f"fit-{PROFILE_FITTED}{tag}", files[PROFILE_FITTED], ripplekv_command(
            "fit", PROFILE_FITTED, *same, "--budget", text(config.sweep_budget), "--out", files[PROFILE_FITTED])))
    return stages


def curve_copies(config: StudyConfig, out: str, draw: int) -> list[tuple[Path, Path]]:
    """(fitted curve, its draw-named copy) pairs, each with its provenance JSON beside it."""
    folder = draw_folder(out, draw)
    pairs = []
    for key, target in fitted_files(config, out, draw).items():
        if key.startswith(f"{PIPELINE_CURVES}@"):
            source = Path(folder) / PIPELINE_CURVES / f"curve-{key.split('@', 1)[1]}.csv"
            pairs += [(source, Path(target)), (source.with_suffix(".json"), Path(target).with_suffix(".json"))]
    return pairs


def cell_spec(allocation: str, scorer: str, split: str, files: dict[str, str]) -> str:
    """One factorial cell as a method spec, its calibrated allocation given draw's file."""
    option = STUDY_CALIBRATED.get(allocation)
    if option == CURVE_OPTION:
        return f"{allocation}:{option}={files[f'{allocation}@{scorer}']}:scorer={scorer}:split={split}"
    prefix = f"{allocation}:{option}={files[allocation]}" if option else allocation
    return f"{prefix}:scorer={scorer}:split={split}"


def grid_specs(config: StudyConfig, files: dict[str, str], only: tuple[str, ...] | None = None) -> list[str]:
    """Every allocation x scorer x split cell (of the allocations in `only`, when given)."""
    return [cell_spec(allocation, scorer, split, files) for allocation in config.allocations
            if only is None or allocation in only for scorer in config.scorers for split in config.splits]


def extra_specs(config: StudyConfig, files: dict[str, str]) -> list[str]:
    """The rows beside the grid (the full cache, StreamingLLM, LU-KV as published...), calibrated ones with files."""
    out = []
    for name in config.extra_methods:
        option = STUDY_CALIBRATED.get(name)
        if option == CURVE_OPTION:
            out.append(f"{name}:{option}={files[f'{name}@{PIPELINE_CURVES}']}")
        elif option:
            out.append(f"{name}:{option}={files[name]}")
        else:
            out.append(name)
    return out


def calibrated_specs(config: StudyConfig, files: dict[str, str]) -> list[str]:
    """The grid cells and extra rows that read a fitted file (what a further draw evaluates again)."""
    calibrated = tuple(name for name in config.allocations if name in STUDY_CALIBRATED)
    extras = [spec for name, spec in zip(config.extra_methods, extra_specs(config, files)) if name in STUDY_CALIBRATED]
    return grid_specs(config, files, calibrated) + extras


def eval_command(choice: Choice, methods: list[str], budgets: tuple, limit: int, out: str,
                 split: str | None = None) -> Command:
    args = ["eval", "--model", choice.model, "--suite", choice.suite, "--tasks", ",".join(choice.tasks)]
    args += [word for budget in budgets for word in ("--budget", text(budget))]
    args += ["--methods", ",".join(methods), "--limit", text(limit), "--target-tokens", text(choice.target_tokens)]
    args += ["--split", split] if split else []
    return ripplekv_command(*args, "--out", out)
