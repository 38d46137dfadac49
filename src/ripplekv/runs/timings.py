"""timings.csv: the seconds each sample spent in each phase of `ripplekv eval`, one row per sample x phase.

Rows are appended, fsynced, right after the sample's result lines, so a resumed run keeps the rows of the
samples already done and never times a sample twice (a finished sample is not run again). A sample that
a later run extends with more variants is prefilled again: those rows carry the next `job` number, as
they are new work. A torn last row (a kill mid-write) is cut when the next run opens the file.

A run stopped anywhere between a sample's lines and its rows (a kill, a full disk) loses neither: the sample's
seconds are staged in `PENDING` before its lines are written (`stage`), appended after them (`commit`), and the
next run finishes or drops what is staged by whether the lines reached the disk (`settle`). A sample with lines
but no rows can then only come from a run of an earlier version: it gets one `UNTIMED` row, so the table still
names every sample the predictions hold, and the report says how many were not timed.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pandas as pd

from ripplekv.errors import UserError
from ripplekv.runs.safeio import append_bytes, cut_to, open_append, write_json

# method: "" for the phases every variant shares; task and sample_id: "" for the run's report
COLUMNS = ("task", "sample_id", "job", "phase", "method", "seconds")
UNTIMED = "untimed"  # the phase of a sample's one row when its lines were written but its times were lost
PENDING = ".timings.pending.json"  # beside timings.csv: the seconds of the sample whose lines are being written


def read_timings(path: str | Path) -> pd.DataFrame:
    """The whole rows of a timings.csv (none when it is missing), seconds as floats."""
    path = Path(path)
    data = path.read_bytes() if path.is_file() else b""
    whole = data[: data.rfind(b"\n") + 1]
    if not whole.strip():
        return pd.DataFrame(columns=list(COLUMNS))
    try:
        frame = pd.read_csv(io.BytesIO(whole), dtype=str, keep_default_na=False)
    except (ValueError, pd.errors.ParserError):
        raise UserError(f"{path} is not a timings table written by `ripplekv eval`; delete it to start it again") from None
    if list(frame.columns) != list(COLUMNS):
        raise UserError(f"{path} has columns {', '.join(frame.columns)}, not {', '.join(COLUMNS)}; delete it to "
                        "start it again")
    frame["seconds"] = pd.to_numeric(frame["seconds"], errors="coerce")
    frame["job"] = pd.to_numeric(frame["job"], errors="coerce").astype("Int64")
    return frame


class TimingsLog:
    """Appends a sample's phase seconds to timings.csv under the next job number of that sample."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.pending = self.path.with_name(PENDING)
        self._cut_torn_row()
        self._read_jobs()

    def _read_jobs(self) -> None:
        frame = read_timings(self.path)
        self.jobs = {key: int(job) for key, job in frame.groupby(["task", "sample_id"])["job"].max().items()}

    def stage(self, task: str, sample_id: str, spent: list[tuple[str, str, float]], rows: list[dict]) -> None:
        """Before a sample's result `rows` are written: its seconds, which (method, budget) lines it writes, and
        where the table ends now, kept in one atomic file."""
        size = self.path.stat().st_size if self.path.is_file() else 0
        write_json(self.pending, {"task": str(task), "sample_id": str(sample_id), "table_bytes": size,
                                  "lines": [[row["method"], row["budget"]] for row in rows],
                                  "spent": [list(item) for item in spent]})

    def commit(self) -> None:
        """After the staged sample's lines are on disk: its rows appended, then the staged file removed."""
        staged = json.loads(self.pending.read_text(encoding="utf-8"))
        self.append(staged["task"], staged["sample_id"], [tuple(item) for item in staged["spent"]])
        self.pending.unlink()

    def settle(self, have: dict) -> None:
        """At a run's start, what a stopped run staged: its rows appended when all its lines are among `have`
        (`runs.resume.existing_lines`), the table first cut back to where it ended before them (rows half
        appended are not doubled); dropped when they are not, as that sample runs again."""
        if not self.pending.is_file():
            return
        try:
            staged = json.loads(self.pending.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            raise UserError(f"{self.pending} is unreadable; delete it (that sample's seconds are lost)") from None
        written = have.get((staged["task"], staged["sample_id"]), {}).get("variants", set())
        if {(method, budget) for method, budget in staged["lines"]} <= written:
            if self.path.is_file() and self.path.stat().st_size > staged["table_bytes"]:
                cut_to(self.path, staged["table_bytes"])
                self._read_jobs()
            self.commit()
        else:
            self.pending.unlink()

    def _cut_torn_row(self) -> None:
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            cut_to(self.path, whole)

    def mark_untimed(self, samples) -> int:
        """One `UNTIMED` row for each (task, sample id) of `samples` that has no row yet; returns how many."""
        missing = [key for key in samples if (str(key[0]), str(key[1])) not in self.jobs]
        for task, sample_id in missing:
            self.append(task, sample_id, [(UNTIMED, "", 0.0)])
        return len(missing)

    def append(self, task: str, sample_id: str, spent: list[tuple[str, str, float]]) -> None:
        """`spent`: (phase, method, seconds) of one job of the sample (`engine.timings.Timings.rows`)."""
        key = (str(task), str(sample_id))
        job = self.jobs.get(key, 0) + 1
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        if not self.path.is_file() or self.path.stat().st_size == 0:
            writer.writerow(COLUMNS)
        for phase, method, seconds in spent:
            writer.writerow([task, sample_id, job, phase, method, f"{seconds:.6f}"])
        with open_append(self.path) as fh:
            append_bytes(fh, text.getvalue().encode("utf-8"))
        self.jobs[key] = job
