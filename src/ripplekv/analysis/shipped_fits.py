"""Files fitted before a run and shipped for the bundled model, and what each was fitted on.

LU-KV's head-budget curve, KVzap's surrogate and FastKVzip's gates ship in `data/` for the bundled model, so a run
that names the method without a file reads them. They were fitted once, on their own calibration prompts (LU-KV's
curve on 8 prompts of 3500 tokens, about 91 min; KVzap's surrogate on 4 of about 500), not in the run's calibration
draws beside RippleKV's profile. A page that compares those rows with the run's own calibrated ones says so, with
the prompts, their tasks, their length and the time each fit took, read from the file's sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path

LEARNED = ("kvzap", "fastkvzip")  # scorers reading a learned weights file (`weights=`)


def shipped_scorer_file(part: dict) -> Path | None:
    """The weights file shipped for the bundled model that learned scorer `part` (a resolved spec's dict) reads."""
    if part.get("name") == "kvzap":
        from ripplekv.methods.kvzap.method import shipped_weights

        return shipped_weights(part.get("model", "mlp"))
    if part.get("name") == "fastkvzip":
        from ripplekv.methods.fastkvzip.method import shipped_gates

        return shipped_gates()
    return None


def _shipped_curve(spec: dict) -> Path | None:
    """LU-KV's shipped curve for the spec's scorer, when its allocator is LU-KV's and was given no curve."""
    allocator, scorer = spec.get("allocator"), spec.get("scorer")
    if not (isinstance(allocator, dict) and allocator.get("name") == "lukv" and not allocator.get("curve")):
        return None
    from ripplekv.engine.packaged import DEFAULT_MODEL
    from ripplekv.methods.lukv.method import SHIPPED

    return SHIPPED / f"{DEFAULT_MODEL}-{(scorer or {}).get('name', 'lukv')}.csv"


def shipped_files(spec: dict) -> list[Path]:
    """The shipped files a resolved spec reads when it runs on the bundled model (none given by option)."""
    files = [path for path in [_shipped_curve(spec)] if path is not None]
    scorer = spec.get("scorer")
    if isinstance(scorer, dict) and scorer.get("name") in LEARNED and not scorer.get("weights"):
        files.append(shipped_scorer_file(scorer))
    return [path for path in files if path is not None]


def _tasks(ids: list[str]) -> list[str]:
    """The tasks of calibration ids (`SUITE-TASK-calibration-NNNN`), in order of first appearance."""
    return list(dict.fromkeys(i.split("-", 1)[-1].rsplit("-calibration-", 1)[0] for i in ids))


def fitted_on(path: Path) -> str | None:
    """What the file at `path` was fitted on, in words, from its JSON sidecar (None without one)."""
    try:
        info = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ids = list(info.get("calibration_ids") or [])
    seconds = info.get("profile_seconds") or (info.get("collect_seconds", 0) + info.get("fit_seconds", 0))
    took = f", {seconds / 60:.0f} min" if seconds else ""
    return (f"{len(ids)} calibration prompts of {info.get('target_tokens')} tokens ({', '.join(_tasks(ids))})"
            f"{took}")


def fitted_elsewhere_lines(eval_dir: Path) -> list[str]:
    """A paragraph naming the run's rows that read a shipped file, and what each file was fitted on (none when
    no row does, or the run's model is not the bundled one)."""
    from ripplekv.analysis.allocation import method_specs
    from ripplekv.analysis.small_fits import bundled_run

    if not bundled_run(eval_dir):
        return []
    said = []
    for label, spec in method_specs(eval_dir).items():
        for path in shipped_files(spec) if isinstance(spec, dict) else ():
            what = fitted_on(path)
            if what is not None:
                said.append(f"`{label}` reads `{path.name}`, fitted on {what}")
    if not said:
        return []
    return ["", "**Fitted before this run.** These rows read a file shipped for the bundled model, fitted once on "
            "other calibration prompts than this run's, so they are in no calibration draw here: " + "; ".join(said)
            + ". `make study` fits every calibrated allocation on the same prompts in each draw."]
