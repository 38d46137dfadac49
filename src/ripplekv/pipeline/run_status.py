"""Where a staged run stands (`ripplekv study CONFIG --status`, `ripplekv reproduce CONFIG --status`).

A study runs for hours in the background, where no progress bar is seen. This reads the staging folder alone (it
never touches a running stage): the stages finished and their time (stages.csv), and for every eval in it the
samples done per task (a sample is done once its timings are written) with an estimate of the time left, from the
seconds a sample has taken so far in that task (a task not started is taken at the mean of the samples done).
Stages not started yet are not in the estimate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def _minutes(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600} h {seconds % 3600 // 60} min" if seconds >= 3600 else f"{max(seconds // 60, 1)} min"


def eval_status(folder: Path, name: str) -> str | None:
    """One line, `name` first: an eval's samples done per task and the time left at its pace so far (None: not
    an eval)."""
    try:
        planned = json.loads((folder / "config.json").read_text(encoding="utf-8"))["samples"]
    except (OSError, ValueError, KeyError):
        return None
    timings = folder / "timings.csv"
    seconds = pd.Series(dtype=float)
    if timings.is_file() and timings.stat().st_size:
        table = pd.read_csv(timings)
        seconds = table.groupby(["task", "sample_id"])["seconds"].sum()
    done = {task: int((seconds.index.get_level_values(0) == task).sum()) if len(seconds) else 0 for task in planned}
    total, finished = sum(len(ids) for ids in planned.values()), sum(done.values())
    per_task = ", ".join(f"{task} {done[task]}/{len(ids)}" for task, ids in planned.items())
    line = f"{name}: {finished} of {total} samples ({per_task})"
    if finished == total:
        return line + ", done"
    if not len(seconds):
        return line + "; no sample done yet, so no estimate"
    mean = seconds.groupby(level=0).mean()
    left = sum((len(ids) - done[task]) * float(mean.get(task, seconds.mean())) for task, ids in planned.items())
    return line + f"; about {_minutes(left)} left at its pace so far"


def run_status(staging: Path) -> list[str]:
    """The lines `--status` prints for the staged run in `staging`."""
    if not staging.is_dir():
        return [f"{staging}: no run in progress (nothing staged)"]
    lines = [f"{staging}: a run in progress (it becomes the output when every stage has succeeded)"]
    times = staging / "stages.csv"
    if times.is_file():
        stages = pd.read_csv(times)
        lines.append(f"stages finished: {', '.join(dict.fromkeys(stages['stage']))} ({len(stages)} runs, "
                     f"{_minutes(stages['seconds'].sum())} in all)")
    folders = sorted({path.parent for path in staging.rglob("config.json") if (path.parent / "predictions.jsonl").exists()})
    lines += [line for folder in folders if (line := eval_status(folder, str(folder.relative_to(staging))))]
    lines.append("Stages not started yet are not in these estimates; rerun the same command to resume after a stop.")
    return lines


def staged_status(final: str) -> list[str]:
    """`run_status` of the staged run that becomes `final` (a config's `out`)."""
    from ripplekv.pipeline.staged import StagedRun

    return run_status(Path(StagedRun(final).out))
