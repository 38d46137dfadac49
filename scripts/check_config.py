"""The pre-flight of scripts/reproduce.sh: every setting of a configs/*.env checked before the first stage.

reproduce.sh sources the config and runs this with the settings in the environment (`set -a`), before any
stage, so a mistake (an unknown task or method, a bad budget, a method whose input comes from a stage the
config leaves off) ends in one `error:` line and exit code 2 within seconds, with nothing built, rather
than after the profile and allocate stages. It reads the model's config (its layer count), never its weights.

Each eval of the pipeline is checked with what reproduce.sh hands it (keep `EVALS` in step with the script):
its methods as the script rewrites them (`depthkv` gets the DepthKV allocation, `compresskv` its profile),
its tasks, budgets and protocol, and the shared inputs it passes (`--allocation`, `--route`), here as
stand-in files in a temporary folder, since the stages that make them have not run yet.

    python scripts/check_config.py configs/NAME.env    # with the config's settings in the environment
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

from ripplekv.cli.options import flag
from ripplekv.errors import UserError

# eval -> (its methods setting, gets --allocation, gets --route, tasks setting, budgets setting, protocol, decode
# budgets, suite setting or a fixed suite, target tokens setting)
EVALS = {
    "eval": ("METHODS", True, True, "TASKS", "BUDGETS", "with-question", ("prompt",), "SUITE", "TARGET_TOKENS"),
    "eval-headline": ("HEADLINE_METHODS", True, False, "TASKS", None, "with-question", ("prompt",), "SUITE",
                      "TARGET_TOKENS"),
    "eval-compare": ("COMPARE_METHODS", False, False, "TASKS", "COMPARE_BUDGETS", "with-question", ("prompt",), "SUITE",
                     "TARGET_TOKENS"),
    "eval-context-only": ("CONTEXT_METHODS", True, False, "TASKS", "CONTEXT_BUDGETS", "context-only", ("prompt",),
                          "SUITE", "TARGET_TOKENS"),
    "eval-memory": ("MEMORY_METHODS", True, False, "TASKS", "MEMORY_BUDGETS", "with-question", ("prompt",), "SUITE",
                    "TARGET_TOKENS"),
    "long": ("LONG_METHODS", True, False, "LONG_TASKS", "LONG_BUDGETS", "with-question", ("prompt", "total"),
             "offline", "LONG_TARGET_TOKENS"),
}
# A method (preset) whose input comes from an optional stage: preset -> (its option, the setting that runs the stage)
STAGE_INPUTS = {"depthkv": ("allocation", "EVICT_CALIB_SAMPLES"), "compresskv": ("profile", "COMPRESSKV_CALIB_SAMPLES"),
                "routed": ("route", "ROUTE_CALIB_SAMPLES"), "routed-ripplekv": ("route", "ROUTE_CALIB_SAMPLES")}
REQUIRED = ("OUT", "CALIB_SAMPLES", "SEEDS", "ETA", "PROBE_TOKENS", "RATIOS", "SWEEP_SAMPLES", "SWEEP_BUDGET", "SUITE",
            "BUDGETS", "METHODS", "LIMIT", "TARGET_TOKENS")
COUNTS = ("CALIB_SAMPLES", "SEEDS", "PROBE_TOKENS", "SWEEP_SAMPLES", "LIMIT", "TARGET_TOKENS", "EVICT_CALIB_SAMPLES",
          "COMPRESSKV_CALIB_SAMPLES", "ROUTE_CALIB_SAMPLES", "HEADLINE_LIMIT", "COMPARE_LIMIT", "CONTEXT_LIMIT",
          "LONG_LIMIT", "LONG_TARGET_TOKENS", "DRAWS", "NEEDLE_LIMIT", "MEMORY_LIMIT")
# Budget lists (and single budgets) a stage takes; an unset one falls back as reproduce.sh says (e.g. BUDGETS).
BUDGET_SETTINGS = ("SWEEP_BUDGET", "ROUTE_BUDGET", "BUDGETS", "CONTEXT_BUDGETS", "LONG_BUDGETS", "COMPARE_BUDGETS",
                   "DRAW_BUDGETS", "NEEDLE_BUDGET", "MEMORY_BUDGETS")


def setting(name: str) -> str:
    return os.environ.get(name, "").strip()


def whole(name: str, minimum: int = 1) -> int | None:
    """An integer setting (None when unset), at least `minimum`."""
    text = setting(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(f"{name}={text!r} must be an integer >= {minimum}")
    return value


def number(name: str, low: float, high: float, closed: bool = True) -> float | None:
    text = setting(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    inside = low <= value <= high if closed else low < value < high
    if not (math.isfinite(value) and inside):
        raise UserError(f"{name}={text!r} must be a number in {'[' if closed else '('}{low:g}, {high:g}"
                        f"{']' if closed else ')'}")
    return value


def budgets(name: str) -> tuple[int, ...]:
    """A budget list setting (an unset COMPARE_BUDGETS or DRAW_BUDGETS is BUDGETS, as reproduce.sh takes it)."""
    from ripplekv.pipeline.eval_plan import parse_budgets

    if not setting(name) and name in ("COMPARE_BUDGETS", "DRAW_BUDGETS"):
        name = "BUDGETS"
    try:
        return parse_budgets(setting(name).split())
    except UserError as err:
        raise UserError(f"{name}={setting(name)!r}: {err}") from None


def check_numbers() -> None:
    for name in REQUIRED:
        if not setting(name):
            raise UserError(f"{name} is not set; every config sets it (see configs/quick.env)")
    for name in COUNTS:
        whole(name)
    whole("PLACEMENTS", minimum=0)
    whole("PLACEMENT_SAMPLES", minimum=0)
    from ripplekv.pipeline.profile import MAX_ETA

    number("ETA", 0, MAX_ETA, closed=False)
    number("PRUNE_RATIO", 0, 1, closed=False)
    number("DEPTHKV_FLOOR", 0, 1)
    for ratio in setting("RATIOS").split():
        try:
            ok = float(ratio) >= 1 and math.isfinite(float(ratio))
        except ValueError:
            ok = False
        if not ok:
            raise UserError(f"RATIOS={setting('RATIOS')!r}: {ratio!r} is not a ratio >= 1")
    for kept in setting("CARRY").split():
        if "/" in kept or kept in (".", ".."):
            raise UserError(f"CARRY={setting('CARRY')!r}: {kept!r} is not a folder name inside OUT (e.g. gemma3)")
    for name in BUDGET_SETTINGS:
        if setting(name):
            budgets(name)
    if setting("ROUTE_CALIB_SAMPLES"):
        if not setting("ROUTE_BUDGET"):
            raise UserError("ROUTE_CALIB_SAMPLES runs the route stage, which needs ROUTE_BUDGET; set it")
        from ripplekv.defaults import DEFAULT_ROUTE_CANDIDATES
        from ripplekv.pipeline.route import check_placement_study

        try:  # unset, both are 0 in reproduce.sh
            check_placement_study(len(DEFAULT_ROUTE_CANDIDATES), whole("PLACEMENTS", 0) or 0,
                                  whole("PLACEMENT_SAMPLES", 0) or 0)
        except UserError as err:
            raise UserError(f"PLACEMENTS/PLACEMENT_SAMPLES: {err}") from None
    for grid in setting("TUNE").split():
        from ripplekv.pipeline.tune import parse_grid

        try:
            parse_grid(grid)
        except UserError as err:
            raise UserError(f"TUNE: {err}") from None
    for name, needs in (("CONTEXT_METHODS", ("CONTEXT_BUDGETS", "CONTEXT_LIMIT")),
                        ("LONG_TASKS", ("LONG_METHODS", "LONG_BUDGETS", "LONG_LIMIT", "LONG_TARGET_TOKENS"))):
        missing = [need for need in needs if setting(name) and not setting(need)]
        if missing:
            raise UserError(f"{name} runs a stage that needs {', '.join(missing)}; set it")


def stage_inputs(specs: list[str], name: str) -> None:
    """A method whose input an optional stage makes is refused when the config leaves that stage off (else it
    would fail after hours, or worse, run on another method's input: `depthkv` on RippleKV's allocation)."""
    from ripplekv.methods.core.spec import parse_spec

    for spec in specs:
        preset, options = parse_spec(spec)
        option, stage = STAGE_INPUTS.get(preset, (None, None))
        if option and option not in options and not (preset == "compresskv" and "errors" in options) \
                and not setting(stage):
            raise UserError(f"{name} names {spec}, whose {option} comes from a stage this config leaves off: set "
                            f"{stage} (the stage that makes it), or drop {preset} from {name}")


def stand_ins(folder: Path, layers: int) -> dict[str, str]:
    """Files in place of what the stages will write: an allocation, a DepthKV allocation, a route, a profile."""
    files = {"allocation": folder / "allocation.csv", "depthkv": folder / "depthkv.csv",
             "route": folder / "ROUTE.csv", "compresskv": folder / "compresskv.csv"}
    rows = "".join(f"{layer},1.0,1.0\n" for layer in range(layers))  # as `ripplekv allocate` writes them
    files["allocation"].write_text("layer,sensitivity,multiplier\n" + rows)
    files["depthkv"].write_text("layer,sensitivity,multiplier\n" + rows)
    files["route"].write_text("layer,method\n" + "".join(f"{layer},snapkv\n" for layer in range(layers)))
    files["compresskv"].write_text("layer,error\n" + "".join(f"{layer},1.0\n" for layer in range(layers)))
    return {key: str(path) for key, path in files.items()}


def rewritten(specs: list[str], files: dict[str, str]) -> list[str]:
    """The specs as reproduce.sh rewrites them when the stages run (depthkv's allocation, compresskv's profile)."""
    out = []
    for spec in specs:
        head, _, rest = spec.partition(":")
        if head == "depthkv" and setting("EVICT_CALIB_SAMPLES") and "allocation=" not in rest:
            spec = f"depthkv:allocation={files['depthkv']}" + (f":{rest}" if rest else "")
        if head == "compresskv" and setting("COMPRESSKV_CALIB_SAMPLES") and "profile=" not in rest:
            spec = f"compresskv:profile={files['compresskv']}" + (f":{rest}" if rest else "")
        out.append(spec)
    return out


def check_evals(layers: int, folder: Path) -> None:
    from ripplekv.methods.core.catalog import build_methods
    from ripplekv.pipeline.eval_plan import EvalSettings, check_decode_budget, parse_names
    from ripplekv.tasks import get_tasks

    files = stand_ins(folder, layers)
    for stage, (name, allocation, route, tasks, budget_name, protocol, modes, suite, target) in EVALS.items():
        if not setting(name):
            continue
        suite_name = suite if suite == "offline" else setting(suite)
        try:
            chosen = get_tasks(suite_name, list(parse_names(setting(tasks))) or None)
        except UserError as err:
            raise UserError(f"{tasks if setting(tasks) else suite} (the {stage} stage): {err}") from None
        if suite_name == "offline":
            from ripplekv.tasks.offline import MAX_TARGET_TOKENS, MIN_TARGET_TOKENS

            tokens = whole(target)
            if tokens is not None and not MIN_TARGET_TOKENS <= tokens <= MAX_TARGET_TOKENS:
                raise UserError(f"{target}={tokens} must be {MIN_TARGET_TOKENS} to {MAX_TARGET_TOKENS} tokens")
        specs = list(parse_names(setting(name), name))
        stage_inputs(specs, name)
        passed = "passes --allocation (RippleKV's) to it" if allocation else "passes it no --allocation"
        try:
            methods = build_methods(rewritten(specs, files), {
                "allocation": files["allocation"] if allocation else None,
                "route": files["route"] if route and setting("ROUTE_CALIB_SAMPLES") else None})
            for mode in modes:
                check_decode_budget(EvalSettings(budgets=budgets(budget_name) if budget_name else (1,), protocol=protocol,
                                                 decode_budget=mode), methods.values())
        except UserError as err:
            said = err.phrased(flag).replace(str(folder) + "/", "")  # reproduce.sh passes these as eval's flags
            raise UserError(f"{name} (the {stage} stage; reproduce.sh {passed}): {said}") from None
        assert chosen
    if setting("NEEDLE_LENGTHS"):
        from ripplekv.pipeline.needle import parse_lengths

        try:
            parse_lengths(setting("NEEDLE_LENGTHS").replace(" ", ","))
            build_methods(list(parse_names(setting("NEEDLE_METHODS") or "full,streamingllm,snapkv,pyramidkv,ripplekv",
                                           "NEEDLE_METHODS")), {"allocation": files["allocation"]})
        except UserError as err:
            said = err.phrased(flag).replace(str(folder) + "/", "")  # reproduce.sh passes these as eval's flags
            raise UserError(f"NEEDLE_LENGTHS/NEEDLE_METHODS (the needle stage; reproduce.sh passes --allocation): {said}") \
                from None


def main() -> int:
    config = sys.argv[1] if len(sys.argv) > 1 else "the config"
    try:
        check_numbers()
        from ripplekv.engine.models import check_model_files, load_config, resolve_model

        model = setting("MODEL") or None
        try:
            resolve_model(model)
            check_model_files(model)
            layers = int(load_config(model).num_hidden_layers)
        except UserError as err:
            raise UserError(f"MODEL: {err}") from None
        with tempfile.TemporaryDirectory(prefix="ripplekv-preflight-") as folder:
            check_evals(layers, Path(folder))
    except UserError as err:
        print(f"error: {config}: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    print(f"== pre-flight: {config} checked (tasks, methods, budgets, stages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
