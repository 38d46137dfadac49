"""The one list of the files each kind of run folder holds (eval, profile, route, inspect), which
the commands that write them, `report` and the output checks (`safeio.check_output`) all read.

Kept apart from `pipeline` so that data flows one way: pipeline -> analysis -> runs.
"""

from __future__ import annotations

from pathlib import Path

from ripplekv.defaults import CEILINGS
from ripplekv.runs.jsonl import read_jsonl

PREDICTIONS = "predictions.jsonl"
CONFIG = "config.json"
REFERENCE = "full"
# Bounds, not methods (the answer-aware oracle): reports mark them and leave them out of ranks.


def is_ceiling(label) -> bool:
    """Whether a method label (`oracle`, `oracle:window=32`) names a ceiling."""
    return str(label).split(":", 1)[0].strip() in CEILINGS


# What each kind of run folder holds. A folder is a run of a kind when it holds one of its markers;
# no command writes into a run folder of another kind (`safeio.check_output`).
REPORT_FILES = ("scores.csv", "leaderboard.csv", "leaderboard_wide.csv", "ranks.csv", "lengths.csv",
                "score_vs_budget.png", "kl_vs_budget.png", "layer_budgets.png", "summary.md", "report.json")
EVAL_FILES = (PREDICTIONS, CONFIG, *REPORT_FILES)
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


def read_lines(path: Path) -> tuple[list[dict], bool]:
    """Parsed lines of a predictions file and whether a trailing partial line (a kill mid-write) was seen."""
    lines = read_jsonl(path)
    return lines.objects, bool(lines.torn)
