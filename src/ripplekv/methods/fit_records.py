"""What the fitted files a run's rows read were fitted on, for its reports.

LU-KV's head-budget curve, KVzap's surrogate and FastKVzip's gates ship in `data/` for the bundled model, so a row
that names the method without a file reads them; they were fitted once, on their own calibration prompts (LU-KV's
curve on 8 prompts of 3500 tokens, about 91 min; KVzap's surrogate on 4 of about 500), not in a run's calibration
draws. A learned scorer given its own file (`weights=`) reads that one. The reports (`analysis.small_fits`) take
these records from the commands that render them, since analysis names no method: one record per file a row reads,
from the file's JSON sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path

LEARNED = ("kvzap", "fastkvzip")  # scorers reading a learned weights file (`weights=`)


def _scorer_file(part: dict, bundled: bool) -> tuple[Path, bool] | None:
    """(the weights file learned scorer `part` reads, whether it is the shipped one), or None."""
    if part.get("weights"):
        return Path(part["weights"]), False
    if not bundled:
        return None
    if part.get("name") == "kvzap":
        from ripplekv.methods.kvzap.method import shipped_weights

        return shipped_weights(part.get("model", "mlp")), True
    from ripplekv.methods.fastkvzip.method import shipped_gates

    return shipped_gates(), True


def _learned_parts(spec):
    """Every dict in a resolved spec that names a learned scorer (a composite nests its parts)."""
    if isinstance(spec, dict):
        if spec.get("name") in LEARNED:
            yield spec
        for value in spec.values():
            yield from _learned_parts(value)
    elif isinstance(spec, list):
        for value in spec:
            yield from _learned_parts(value)


def _curve_file(spec: dict, bundled: bool) -> tuple[Path, bool] | None:
    """LU-KV's shipped curve for the spec's scorer, when its allocator is LU-KV's and was given no curve."""
    allocator, scorer = spec.get("allocator"), spec.get("scorer")
    if not (bundled and isinstance(allocator, dict) and allocator.get("name") == "lukv" and not allocator.get("curve")):
        return None
    from ripplekv.methods.lukv.method import shipped_curve

    return shipped_curve((scorer or {}).get("name", "lukv")), True


def _tasks(ids: list[str]) -> list[str]:
    """The tasks of calibration ids (`SUITE-TASK-calibration-NNNN`), in order of first appearance."""
    return list(dict.fromkeys(i.split("-", 1)[-1].rsplit("-calibration-", 1)[0] for i in ids))


def record(path: Path, shipped: bool, learned: bool) -> dict | None:
    """What the file at `path` was fitted on, from its JSON sidecar (None without one)."""
    try:
        info = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ids = list(info.get("calibration_ids") or [])
    seconds = info.get("profile_seconds") or (info.get("collect_seconds", 0) + info.get("fit_seconds", 0))
    trained = info.get("train_prompts")
    prompts = int(trained) + int(info.get("held_out_prompts") or 0) if trained is not None else len(ids)
    return {"file_name": path.name, "shipped": shipped, "learned": learned, "prompts": prompts,
            "train_prompts": trained, "train_pairs": info.get("train_pairs"),
            "target_tokens": info.get("target_tokens"), "tasks": _tasks(ids), "seconds": seconds or None}


def fit_records(specs: dict, bundled: bool) -> dict[str, list[dict]]:
    """label -> a record per fitted file the row reads (`specs`: label -> resolved spec, config.json's; `bundled`:
    the run's model is the bundled one, whose shipped files a row without a file option reads)."""
    records: dict[str, list[dict]] = {}
    for label, spec in specs.items():
        if not isinstance(spec, dict):
            continue
        found = [(path, shipped, True) for part in _learned_parts(spec) if (hit := _scorer_file(part, bundled))
                 for path, shipped in [hit]]
        curve = _curve_file(spec, bundled)
        found += [(curve[0], curve[1], False)] if curve else []
        kept = [r for path, shipped, learned in found if (r := record(path, shipped, learned)) is not None]
        if kept:
            records[label] = kept
    return records


def run_fit_records(run_dir: str | Path) -> dict[str, list[dict]]:
    """`fit_records` of an eval run, from its config.json (its specs and whether its model is the bundled one)."""
    from ripplekv.engine.packaged import names_bundled

    try:
        config = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return fit_records(dict(config.get("method_specs") or {}), names_bundled(config.get("model")))
