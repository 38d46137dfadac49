"""The pre-flight of a reproduce config: what needs the registries and the model's config, before any stage.

`config.load_config` has checked each setting's kind and range. Here: the tune grids, the placement study, the
model (its config, never its weights: the layer count), and every eval exactly as the run declares it
(`evals.declared_evals`) with stand-in files in place of what the calibration stages will write: its tasks,
target length, methods (as rewritten with the stages' files), budgets, protocol and decode budget. A method
whose input comes from a stage the config leaves off is refused (else it would fail after hours, or worse, run
on another method's input). A mistake is one UserError naming the setting and the stage.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ripplekv.defaults import MULTI_QUESTION_PROTOCOLS, PIPELINE_FED
from ripplekv.errors import UserError, cli_flag
from ripplekv.pipeline.reproduce.config import ReproduceConfig, joined
from ripplekv.pipeline.reproduce.evals import EvalSpec, declared_evals, fed_lists

# The stage that makes a stage-fed method's input -> the setting that turns it on.
STAGE_SETTINGS = {"allocate-depthkv": "evict_calib_samples", "compresskv-profile": "compresskv_calib_samples",
                  "route": "route_calib_samples"}


def stage_files(config: ReproduceConfig, out: str) -> dict[str, str]:
    """stage -> the file it writes that a stage-fed method reads, for each such stage the config runs."""
    files = {"allocate-depthkv": f"{out}/depthkv.csv", "compresskv-profile": f"{out}/compresskv.csv"}
    return {stage: path for stage, path in files.items() if getattr(config, STAGE_SETTINGS[stage])}


def check_stage_inputs(config: ReproduceConfig, spec: EvalSpec) -> None:
    """Refuse a stage-fed method whose stage the config leaves off (and that names no file of its own)."""
    from ripplekv.methods.core.spec import parse_spec

    for entry in spec.methods.split(","):
        preset, options = parse_spec(entry)
        option, stage, stand_ins = PIPELINE_FED.get(preset, (None, None, ()))
        if option and option not in options and not any(o in options for o in stand_ins) \
                and not getattr(config, STAGE_SETTINGS[stage]):
            raise UserError(f"{spec.setting} names {entry}, whose {option} comes from a stage this config leaves "
                            f"off: set {STAGE_SETTINGS[stage]} (the stage that makes it), or drop {preset} from "
                            f"{spec.setting}")


def _stand_ins(folder: Path, layers: int) -> None:
    """Files in place of what the stages will write: an allocation, a DepthKV allocation, a route, a profile."""
    rows = "".join(f"{layer},1.0,1.0\n" for layer in range(layers))  # as `ripplekv allocate` writes them
    (folder / "allocation.csv").write_text("layer,sensitivity,multiplier\n" + rows)
    (folder / "depthkv.csv").write_text("layer,sensitivity,multiplier\n" + rows)
    (folder / "route").mkdir()
    (folder / "route" / "ROUTE.csv").write_text("layer,method\n" + "".join(f"{layer},snapkv\n" for layer in range(layers)))
    (folder / "compresskv.csv").write_text("layer,error\n" + "".join(f"{layer},1.0\n" for layer in range(layers)))


def check_eval(config: ReproduceConfig, spec: EvalSpec, folder: str) -> None:
    from ripplekv.methods.core.catalog import build_methods
    from ripplekv.pipeline.eval_plan import EvalSettings, check_decode_budget, check_multi_question
    from ripplekv.tasks import get_tasks
    from ripplekv.tasks.registry import multi_question_tasks

    multi = spec.protocol in MULTI_QUESTION_PROTOCOLS
    tasks_setting = "long_tasks" if spec.decode_budget else "multi_tasks" if multi else "tasks"
    if spec.lengths is None:
        try:
            (multi_question_tasks if multi else get_tasks)(spec.suite, list(spec.tasks) if spec.tasks else None)
        except UserError as err:
            raise UserError(f"{tasks_setting if spec.tasks else 'suite'} (the {spec.name} stage): {err}") from None
        if spec.suite == "offline":
            from ripplekv.tasks.offline import MAX_TARGET_TOKENS, MIN_TARGET_TOKENS

            if not MIN_TARGET_TOKENS <= spec.target_tokens <= MAX_TARGET_TOKENS:
                setting = "long_target_tokens" if spec.decode_budget else "target_tokens"
                raise UserError(f"{setting} = {spec.target_tokens} must be {MIN_TARGET_TOKENS} to {MAX_TARGET_TOKENS} "
                                "tokens")
    check_stage_inputs(config, spec)
    passed = "passes --allocation (RippleKV's) to it" if spec.allocation else "passes it no --allocation"
    try:
        if spec.lengths is not None:
            from ripplekv.pipeline.needle import parse_lengths

            parse_lengths(joined(spec.lengths))
        methods = build_methods(spec.methods.split(","), {"allocation": spec.allocation, "route": spec.route})
        settings = EvalSettings(budgets=spec.budgets, protocol=spec.protocol or "with-question",
                                decode_budget=spec.decode_budget or "prompt")
        if multi:
            check_multi_question(settings, methods)
        if spec.lengths is None:
            check_decode_budget(settings, methods.values())
    except UserError as err:
        said = err.phrased(cli_flag).replace(folder + "/", "")  # the pipeline passes these as the commands' flags
        raise UserError(f"{spec.setting} (the {spec.name} stage; the pipeline {passed}): {said}") from None


def check_config(config: ReproduceConfig) -> None:
    """Everything the run will hand its stages, checked before the first one (UserError on the first mistake)."""
    for grid in config.tune or ():
        from ripplekv.pipeline.tune import parse_grid

        try:
            parse_grid(grid)
        except UserError as err:
            raise UserError(f"tune: {err}") from None
    if config.route_calib_samples:
        from ripplekv.defaults import DEFAULT_ROUTE_CANDIDATES
        from ripplekv.pipeline.route import check_placement_study

        try:
            check_placement_study(len(DEFAULT_ROUTE_CANDIDATES), config.placements or 0, config.placement_samples or 0)
        except UserError as err:
            raise UserError(f"placements/placement_samples: {err}") from None
    from ripplekv.engine.models import check_model_files, load_config, resolve_model

    try:
        resolve_model(config.model)
        check_model_files(config.model)
        layers = int(load_config(config.model).num_hidden_layers)
    except UserError as err:
        raise UserError(f"model: {err}") from None
    with tempfile.TemporaryDirectory(prefix="ripplekv-preflight-") as folder:
        _stand_ins(Path(folder), layers)
        files = stage_files(config, folder)
        methods, headline = fed_lists(config, files)
        route = f"{folder}/route/ROUTE.csv" if config.route_calib_samples else None
        for spec in declared_evals(config, folder, methods, headline, route):
            check_eval(config, spec, folder)
