"""An eval run directory's config.json: whether a new command may write into it, and what it records after.

`check_run_dir` accepts a new or empty directory, or an earlier `ripplekv eval` run whose config
matches on every key that defines results (`NOT_COMPARED` and `GROWABLE` keys aside, method specs
compared method by method without their file paths, the allocation's hash only when both runs read it);
`merge_config` records the union a grown run covers. It lives in pipeline, not runs, because comparing
method specs asks the methods which options are files and which methods read --allocation.
"""

from __future__ import annotations

import json
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.runs.files import ANSWER_AWARE, CONFIG, EVAL_FILES, PREDICTIONS, is_ceiling, run_ceilings
from ripplekv.runs.safeio import check_output, other_files, setting_difference

# config.json keys a run may grow in: a rerun adds the missing lines and the union is recorded.
GROWABLE = ("budgets", "methods", "method_specs", ANSWER_AWARE, "tasks", "limit", "samples")
# config.json keys that do not change results, so a rerun may differ in them (the allocation's hash
# is compared only when both runs have a method that reads --allocation; method specs, which hold the
# files' contents, are compared method by method; the capture window follows the methods, and queries
# captured beyond a method's window are never read).
NOT_COMPARED = ("ripplekv_version", "model", "model_location", "allocation", "allocation_sha256", "route",
                "route_sha256", "versions", "device_name", "capture_window", *GROWABLE)
# Keys that runs made before them lack: compared only when both configs have them. A model is the same
# model by its label and its weights' fingerprint, not by where its file lies (another checkout, another
# virtual environment), so a committed run can be grown anywhere.
RECORDED_LATER = ("model_sha256",)


def _without_file_paths(spec: dict) -> dict:
    """A method spec without where its files were: their contents (multipliers, the route's methods) are
    recorded beside the paths and decide the output, so a run whose allocation moved (make reproduce's
    staging folder -> results/) can still be grown with the moved file."""
    from ripplekv.methods.core.spec import file_options

    files = file_options()
    return {part: ({k: v for k, v in options.items() if k not in files} if isinstance(options, dict) else options)
            for part, options in spec.items()}


def _differing(old: dict, new: dict, keys) -> list[str]:
    differing = [key for key in keys if key not in NOT_COMPARED and old.get(key) != new.get(key)
                 and not (key in RECORDED_LATER and key not in old)]
    if "decode_budget" in old and "decode_budget" not in new:  # prompt budgets record nothing: never mix into a total run
        differing.append("decode_budget")
    # A method both runs name must be the same method: its resolved options (multipliers, route, ...) too.
    old_specs, new_specs = old.get("method_specs", {}), new.get("method_specs", {})
    changed = [label for label in set(old_specs) & set(new_specs)
               if _without_file_paths(old_specs[label]) != _without_file_paths(new_specs[label])]
    if changed:
        differing.append(f"options of {', '.join(sorted(changed))}")
    both_read_it = allocation_readers(old) & allocation_readers(new)
    if both_read_it and "allocation_sha256" in keys and old.get("allocation_sha256") != new.get("allocation_sha256"):
        differing.append("allocation_sha256")
    return differing


def allocation_readers(config: dict) -> set[str]:
    """The methods of a run that read its --allocation: their allocator (or a quantizer's bits=profile) takes an
    allocation that their own spec does not name (as the method specs in config.json record them)."""
    from ripplekv.methods import parse_spec
    from ripplekv.methods.core.spec import reads_allocation

    specs = config.get("method_specs", {})
    return {label for label in config.get("methods", ())
            if "allocation" not in parse_spec(label)[1] and reads_allocation(specs.get(label, {}))}


def merge_config(old: dict | None, new: dict) -> dict:
    """The config of a run grown by `new`: union of budgets, methods, tasks and samples."""
    if old is None:
        return new
    merged = dict(new)
    merged["budgets"] = sorted(set(old["budgets"]) | set(new["budgets"]))
    merged["methods"] = list(dict.fromkeys([*old["methods"], *new["methods"]]))
    merged["method_specs"] = {**old.get("method_specs", {}), **new.get("method_specs", {})}
    known = run_ceilings(old)  # a run written before the record: its ceilings by name
    known = known if known is not None else {m for m in old["methods"] if is_ceiling(m)}
    aware = {*known, *new.get(ANSWER_AWARE, ())} - {m for m in new["methods"] if m not in new.get(ANSWER_AWARE, ())}
    merged[ANSWER_AWARE] = [m for m in merged["methods"] if m in aware]
    merged["tasks"] = list(dict.fromkeys([*old["tasks"], *new["tasks"]]))
    limits = (old.get("limit"), new.get("limit"))
    merged["limit"] = None if None in limits else max(limits)
    samples = {task: list(ids) for task, ids in old.get("samples", {}).items()}
    for task, ids in new.get("samples", {}).items():
        samples[task] = list(dict.fromkeys([*samples.get(task, []), *ids]))
    merged["samples"] = samples
    if not allocation_readers(new):  # the allocation that made the old lines of the methods that read it
        merged["allocation"], merged["allocation_sha256"] = old.get("allocation"), old.get("allocation_sha256")
    return merged


# Everything `eval` writes into its run directory (plus report.render's files).
RUN_FILES = EVAL_FILES


def check_run_dir(out: Path, config: dict, keys=None) -> dict | None:
    """The existing config of `out` if it matches `config` on `keys`; a UserError naming the differences otherwise.

    `out` must be a writable directory that holds no inputs of the run, and either a new or empty one
    or an earlier `ripplekv eval` run: eval never writes into a folder holding anything else.
    """
    model = config.get("model_location") if str(config.get("model_location") or "").endswith(".gguf") else None
    check_output(out, kind="dir", inputs=[config.get("allocation"), config.get("route"), model], writes=RUN_FILES, run="eval")
    config_path, predictions = out / CONFIG, out / PREDICTIONS
    if not config_path.is_file():
        if predictions.exists():
            raise UserError(f"{out} holds {PREDICTIONS} but no {CONFIG}; use a new --out directory")
        foreign = other_files(out, RUN_FILES)
        if foreign:
            what = "a ripplekv profile" if "profile.json" in foreign else "other files (" + ", ".join(foreign[:3]) + ")"
            raise UserError(f"--out {out} holds {what}, not an eval run; pass a new or empty directory")
        return None
    if not predictions.is_file() or not predictions.read_bytes().strip():
        return None  # nothing computed yet: the new config simply replaces the old one
    try:
        old = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        raise UserError(f"{config_path} is unreadable; use a new --out directory") from None
    differing = _differing(old, config, keys if keys is not None else config.keys())
    if differing:
        raise UserError(
            f"{out} holds a run with a different configuration (differs in: "
            f"{', '.join(setting_difference(key, old, config) for key in differing)}); use a new --out directory, or "
            "the run's own settings to grow it (a run may only grow in budgets, methods, tasks and --limit)"
        )
    return old

