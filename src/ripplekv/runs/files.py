"""The one list of the files each kind of run folder holds (eval, profile, route, inspect), which
the commands that write them, `report` and the output checks (`safeio.check_output`) all read.

Kept apart from `pipeline` so that data flows one way: pipeline -> analysis -> runs.
"""

from __future__ import annotations

from pathlib import Path

from ripplekv.defaults import CEILINGS
from ripplekv.runs.jsonl import read_jsonl, torn_fields

PREDICTIONS = "predictions.jsonl"
CONFIG = "config.json"
REFERENCE = "full"
# Bounds, not methods: variants with a part that knows the full cache's answer (`Scorer.knows_answer`).
# Reports mark them and leave them out of ranks. config.json lists their labels under this key, since
# reports read result lines, not methods; runs written before it fall back to the names in CEILINGS.
ANSWER_AWARE = "answer_aware"


def is_ceiling(label, ceilings=None) -> bool:
    """Whether a method label is a ceiling: one of `ceilings` (a run's recorded labels, `run_ceilings`), or
    when a run records none, a label whose preset is named in `defaults.CEILINGS` (`oracle:window=32`)."""
    if ceilings is not None:
        return str(label) in ceilings
    return str(label).split(":", 1)[0].strip() in CEILINGS


def run_ceilings(config) -> frozenset[str] | None:
    """The labels a run's config.json records as knowing the answer; None for runs that predate the record."""
    recorded = config.get(ANSWER_AWARE) if isinstance(config, dict) else None
    return frozenset(map(str, recorded)) if isinstance(recorded, list) else None


# What each kind of run folder holds. A folder is a run of a kind when it holds one of its markers;
# no command writes into a run folder of another kind (`safeio.check_output`).
REPORT_FILES = ("scores.csv", "informative.csv", "leaderboard.csv", "headline.csv", "leaderboard_wide.csv", "ranks.csv",
                "lengths.csv", "allocation_only.csv",
                "allocation_only.md", "memory_axis.csv", "memory_axis.md", "score_vs_budget.png", "kl_vs_budget.png", "layer_budgets.png", "kl_forest.png",
                "score_forest.png", "memory_axis.png", "follow_ups.csv", "follow_ups.md", "summary.md", "report.json",
                "index.html")
# written only when the run holds what they show (samples with a prompt length; several allocators with one scorer)
OPTIONAL_REPORT_FILES = ("lengths.csv", "allocation_only.csv", "allocation_only.md", "memory_axis.csv", "memory_axis.md",
                         "memory_axis.png", "follow_ups.csv", "follow_ups.md")
TIMINGS = "timings.csv"  # seconds per sample and phase, appended as samples finish (`runs.timings`)
EVAL_FILES = (PREDICTIONS, CONFIG, TIMINGS, *REPORT_FILES)
SAMPLES_LOG = "samples.jsonl"  # one fsynced line per finished calibration sample: what a rerun resumes from
PROFILE_FILES = ("sensitivity.csv", "per_sample.csv", "profile.json", "sensitivity.png", SAMPLES_LOG)
ROUTE_FILES = ("ROUTE.csv", "preferences.csv", "preferences_per_sample.csv", "placements.csv",
               "placements_per_sample.csv", "route.json",
               "preferences.png", "ROUTE.png", "placements.png")
INSPECT_FILES = ("kept.npz", "kept.png")
RUNS = {  # kind: (how it is named to the user, marker files, every file it writes)
    "eval": ("an eval run", (PREDICTIONS,), EVAL_FILES),
    "profile": ("a ripplekv profile", ("profile.json", SAMPLES_LOG), PROFILE_FILES),
    "route": ("a ripplekv route", ("route.json", "ROUTE.csv"), ROUTE_FILES),
    "inspect": ("a ripplekv inspect folder", ("kept.npz",), INSPECT_FILES),
}


def run_kind(folder: Path) -> str | None:
    """The kind of run `folder` holds, or None (not a folder, or no run's markers)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for kind, (_, markers, _) in RUNS.items():
        if any((folder / name).is_file() for name in markers):
            return kind
    return None


def report_is_current(folder: Path) -> bool:
    """Whether an eval folder's report is there and no older than the predictions and config it renders: every
    file `report.render` always writes, each written after both (a render cut short, or lines appended after
    it, leave it stale)."""
    inputs = [Path(folder) / PREDICTIONS, Path(folder) / CONFIG]
    if not all(path.is_file() for path in inputs):
        return False
    newest = max(path.stat().st_mtime_ns for path in inputs)
    files = [Path(folder) / name for name in REPORT_FILES if name not in OPTIONAL_REPORT_FILES]
    return all(path.is_file() and path.stat().st_mtime_ns >= newest for path in files)


def read_lines(path: Path) -> tuple[list[dict], bool]:
    """Parsed lines of a predictions file and whether a trailing partial line (a kill mid-write) was seen."""
    lines = read_jsonl(path)
    return lines.objects, bool(lines.torn)


def sample_of(row: dict) -> str:
    """The sample a result line belongs to: its `id`, or the `context_id` its questions share when one context is
    asked several questions (`--protocol multi-question`: a line per question, `<context>#q<k>`)."""
    return row.get("context_id") or row.get("id")


def without_torn_sample(path: Path, rows: list[dict], torn: bytes, say=None) -> list[dict]:
    """`rows` less the sample the torn line belongs to (its readable `task`/`id`, else the last whole
    line's sample, as `eval` cuts it when it resumes); says which through `say(text)` (default: a line on
    stderr, as the commands speak; the Python API passes a warning)."""
    import sys

    found = torn_fields(torn, ("task", "id", "context_id", "method", "budget"))
    last = rows[-1] if rows else {}
    task = found.get("task", last.get("task") if "id" not in found else None)
    sid = (found.get("context_id") or found["id"]) if "id" in found else sample_of(last)
    variant = f"{found['method']}@{found.get('budget')}" if "method" in found else "not readable"
    kept = [r for r in rows if not (sample_of(r) == sid and (task is None or r.get("task") == task))]
    sample = f"{task}/{sid}" if task is not None else str(sid)
    text = (f"note: {path} ends in a torn line (a kill mid-write; variant {variant}, sample {sample}): "
            f"{len(rows) - len(kept)} lines of that sample are left out of this report; rerun `ripplekv eval` "
            "with the same options to finish it")
    (say or (lambda line: print(line, file=sys.stderr)))(text)
    return kept
