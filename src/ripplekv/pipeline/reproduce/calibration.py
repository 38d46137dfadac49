"""The calibration stages of a reproduce config, once per calibration draw (#42), declared as data.

The calibration split is dealt into `draws` disjoint draws (sample i of every task goes to draw i mod draws; none
is an evaluation sample), and every calibrated method is calibrated on each: RippleKV's profile and ratio,
DepthKV's task-drop profile and allocation (with the signals that might predict the drop), CompressKV's
profile, the route. Draw 0 writes where a single draw always did (OUT/profile, OUT/allocation.csv, ...) and is
what `methods` evaluates; draw d >= 1 writes into OUT/draws/dD/, its files named -dD (an eval label shows a
file's name only). The stages of one draw take the first N prompts of that draw, so they share prompts; the
placement study is draw 0's alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ripplekv.defaults import PIPELINE_CURVES, PIPELINE_FED
from ripplekv.pipeline.reproduce.config import ReproduceConfig, text
from ripplekv.pipeline.staged import Command, ripplekv_command


@dataclass(frozen=True)
class Stage:
    """A stage skipped when `marker` exists and its recorded command is `command`."""

    name: str
    marker: str
    command: Command


def fitter_command(fitter: str, *args: str) -> Command:
    """The command that fits `fitter` (compresskv, lukv) on calibration prompts: `ripplekv fit FITTER`."""
    return ripplekv_command("fit", fitter, *args)


def fitted(stage: str) -> str:
    """The preset whose input `stage` fits (defaults.PIPELINE_FED), which names its fitter."""
    return next(preset for preset, (_, made_by, _) in PIPELINE_FED.items() if made_by == stage)


def calibration_stages(config: ReproduceConfig, draw: int, folder: str) -> list[Stage]:
    """Every configured calibration stage of `draw`, into `folder` (OUT for draw 0, OUT/draws/dD after)."""
    tag = f"-d{draw}" if draw else ""
    model = ["--model", config.model] if config.model else []
    draws = ["--calib-draw", str(draw), "--calib-draws", str(config.draw_count)] if config.draw_count > 1 else []
    tokens = ["--target-tokens", text(config.target_tokens)]
    probe = ["--probe-tokens", text(config.probe_tokens)]
    # the calibration options steer the choice among several ratios; allocate refuses them beside one ratio
    sweep = (["--budget", text(config.sweep_budget), "--calib-samples", text(config.sweep_samples), *draws]
             if len(set(config.ratios)) > 1 else [])
    stages = [
        Stage(f"profile{tag}", f"{folder}/profile/sensitivity.csv", ripplekv_command(
            "profile", *model, "--calib-samples", text(config.calib_samples), *draws, "--seeds", text(config.seeds),
            "--eta", text(config.eta), *probe, *tokens, "--out", f"{folder}/profile")),
        Stage(f"allocate{tag}", f"{folder}/allocation{tag}.csv", ripplekv_command(
            "allocate", f"{folder}/profile/sensitivity.csv", *model,
            *[word for ratio in config.ratios for word in ("--ratio", text(ratio))], *sweep, *tokens,
            "--out", f"{folder}/allocation{tag}.csv")),
    ]
    if config.evict_calib_samples:
        # DepthKV: its sensitivity as published, the task-score drop with each layer alone pruned by prune_ratio,
        # budgets proportional to it; beside it the signals that might predict the drop on the same samples.
        samples = ["--calib-samples", text(config.evict_calib_samples), *draws]
        ratio = text(config.prune_ratio) if config.prune_ratio is not None else "0.6"
        floor = ["--floor", text(config.depthkv_floor)] if config.depthkv_floor is not None else []
        stages += [
            Stage(f"profile-evict{tag}", f"{folder}/profile-evict/sensitivity.csv", ripplekv_command(
                "profile", *model, "--signal", "evict", "--measure", "task-drop", "--prune-ratio", ratio, *samples,
                *tokens, "--out", f"{folder}/profile-evict")),
            Stage(f"allocate-depthkv{tag}", f"{folder}/depthkv{tag}.csv", ripplekv_command(
                "allocate", f"{folder}/profile-evict/sensitivity.csv", *model, "--map", "proportional", *floor,
                "--out", f"{folder}/depthkv{tag}.csv")),
            Stage(f"profile-evict-kl{tag}", f"{folder}/profile-evict-kl/sensitivity.csv", ripplekv_command(
                "profile", *model, "--signal", "evict", "--measure", "kl", "--evict-budget", text(config.sweep_budget),
                *samples, *probe, *tokens, "--out", f"{folder}/profile-evict-kl")),
            Stage(f"profile-infonce{tag}", f"{folder}/profile-infonce/sensitivity.csv", ripplekv_command(
                "profile", *model, "--signal", "infonce", *samples, *tokens, "--out", f"{folder}/profile-infonce")),
        ]
    if config.compresskv_calib_samples:  # CompressKV's offline layer error profile
        stages.append(Stage(f"compresskv-profile{tag}", f"{folder}/compresskv{tag}.csv", fitter_command(
            fitted("compresskv-profile"), *model, "--calib-samples", text(config.compresskv_calib_samples), *draws,
            "--budget", text(config.sweep_budget), *tokens, "--out", f"{folder}/compresskv{tag}.csv")))
    if config.route_calib_samples:  # a method per layer, and (draw 0) the placement study
        placements = text(config.placements or 0) if draw == 0 else "0"
        stages.append(Stage(f"route{tag}", f"{folder}/route/ROUTE.csv", ripplekv_command(
            "route", *model, "--budget", text(config.route_budget), "--calib-samples", text(config.route_calib_samples),
            *draws, "--placements", placements, "--placement-samples", text(config.placement_samples or 0), *probe,
            *tokens, "--out", f"{folder}/route")))
    return stages


def lukv_stage(config: ReproduceConfig, out: str, methods: str) -> tuple[Stage | None, str]:
    """LU-KV's head-budget curves profiled on calibration prompts at this run's prompt length, one per scorer of
    the LU-KV entries of `methods`, and `methods` with each entry given its curve (label: curve-SCORER.csv).
    (None, methods) when lukv_calib_samples is unset or no entry is LU-KV's (it then reads the shipped curves)."""
    entries = methods.split(",")
    ours = [entry for entry in entries if re.match(rf"^{PIPELINE_CURVES}(:|$)", entry)]
    if not config.lukv_calib_samples or not ours:
        return None, methods

    def scorer(entry: str) -> str:
        found = re.findall(r":scorer=([^:]*)", entry)
        return found[-1] if found else PIPELINE_CURVES

    first = re.match(r"^[^,]*:scorer=([^:,]*)", ours[0])
    model = ["--model", config.model] if config.model else []
    stage = Stage("lukv-profile", f"{out}/lukv/curve-{first.group(1) if first else PIPELINE_CURVES}.json",
                  fitter_command(PIPELINE_CURVES, *model, "--methods", ",".join(ours), "--calib-samples",
                                 text(config.lukv_calib_samples), *["--target-tokens", text(config.target_tokens)],
                                 "--out", f"{out}/lukv"))
    with_curves = [f"{entry}:curve={out}/lukv/curve-{scorer(entry)}.csv" if entry in ours else entry
                   for entry in entries]
    return stage, ",".join(with_curves)


def tune_stage(config: ReproduceConfig, out: str) -> Stage | None:
    """The baselines' knobs their papers tune per model, chosen as RippleKV's ratio is (teacher-forced KL at
    sweep_budget) on draw 0's sweep_samples prompts, the grid extended past an edge pick; None without `tune`."""
    if not config.tune:
        return None
    model = ["--model", config.model] if config.model else []
    draws = ["--calib-draw", "0", "--calib-draws", str(config.draw_count)] if config.draw_count > 1 else []
    return Stage("tune", f"{out}/tune.json", ripplekv_command(
        "tune", *config.tune, *model, "--budget", text(config.sweep_budget), "--calib-samples",
        text(config.sweep_samples), *draws, "--target-tokens", text(config.target_tokens), "--out", f"{out}/tune.json"))
