"""A staged run: a pipeline's stages built in a staging folder that replaces the output only when all succeeded.

`make reproduce` (pipeline.reproduce) is one pipeline on it; another (a long study) declares its own stages and
config and reuses this. What it keeps, so an interrupted run never leaves the output half-written and never
loses work:
- Stages write into `runs/.staging/NAME` (NAME: the output folder's name). A rerun resumes there.
- A stage with a marker file (its last output) is skipped when the marker exists and the stage's recorded
  command (`.NAME.cmd`) is the one wanted now; otherwise it runs (the command resumes what it can itself).
- An eval-like stage (no marker) always runs: it resumes itself.
- Each stage's command is recorded with the output folder in place of the staging path (where its files end
  up; the results page lists them), and its wall time appended to `stages.csv` (a resumed run appends).
- At the end, CARRY folders of the earlier output are copied in unchanged, the page is written, every `.lock`
  removed, the staging paths inside the runs' records (config.json, pages, tables) pointed at the output, the
  earlier output moved to `runs/previous-NAME-DATE` (never deleted) and the staging folder put in its place.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError

PROGRAM = __name__.split(".")[0]  # the command a stage runs: this package's own
STAGING = "runs/.staging"
PREVIOUS = "runs"
RECORDS = (".json", ".html", ".csv")  # the files that may name a staging path; never predictions (.jsonl)


class StageFailed(Exception):
    """A stage's command failed; its own error is already printed. `code` is its exit status."""

    def __init__(self, stage: str, code: int):
        super().__init__(f"{stage} exited with {code}")
        self.stage, self.code = stage, code


@dataclass(frozen=True)
class Command:
    """What a stage runs (`argv`) and how it is shown and recorded (`shown`: as one would type it)."""

    argv: tuple[str, ...]
    shown: tuple[str, ...]


def ripplekv_command(*args: str) -> Command:
    """`ripplekv ARGS`, run by this interpreter (`RIPPLEKV_PROGRAM` in the environment, a command line, replaces it:
    the tests' stand-in)."""
    given = os.environ.get("RIPPLEKV_PROGRAM")
    program = shlex.split(given) if given else [sys.executable, "-m", PROGRAM]
    return Command((*program, *args), (PROGRAM, *args))


def script_command(script: str, *args: str) -> Command:
    """`python scripts/SCRIPT ARGS`, run by this interpreter from the current folder (the repository)."""
    if not Path(script).is_file():
        raise UserError(f"{script} is missing: run the pipeline from the repository's root folder")
    return Command((sys.executable, script, *args), ("python", script, *args))


def _words(record: str) -> list[str]:
    """A recorded command's words, its program by name (`.venv/bin/ripplekv` = `ripplekv`): records made by the
    earlier bash runner (`printf %q`, commas escaped) compare equal to this runner's."""
    try:
        words = shlex.split(record)
    except ValueError:
        return [record]
    if words and Path(words[0]).name in (PROGRAM, "python"):
        words[0] = Path(words[0]).name
    fitter = re.fullmatch(r"scripts/(\w+)_profile\.py", words[1]) if words[:1] == ["python"] and len(words) > 1 else None
    if fitter:  # a fitter's script before `ripplekv fit` (the same options, the same output)
        words[:2] = [PROGRAM, "fit", fitter.group(1)]
    return words


class StagedRun:
    """One run of a pipeline into `final`, built in runs/.staging/NAME."""

    def __init__(self, final: str):
        self.final = final.rstrip("/")
        self.out = f"{STAGING}/{Path(self.final).name}"
        self.began = time.monotonic()

    def begin(self) -> None:
        if Path(self.out).is_dir():
            print(f"== resuming the interrupted run in {self.out} (becomes {self.final} when it completes)", flush=True)
        else:
            print(f"== building in {self.out}; {self.final} is replaced only when the whole pipeline succeeds",
                  flush=True)
        Path(self.out).mkdir(parents=True, exist_ok=True)

    def path(self, *parts: str) -> str:
        """A path inside the staging folder, as text (commands carry it)."""
        return "/".join((self.out, *parts))

    def record(self, shown: Sequence[str]) -> str:
        """The command as recorded: shell-quoted, the final folder in place of the staging one."""
        return shlex.join(shown).replace(self.out, self.final)

    def _recorded(self, name: str) -> Path:
        return Path(self.out) / f".{name}.cmd"

    def up_to_date(self, name: str, marker: str, wanted: str) -> bool:
        recorded = self._recorded(name)
        return Path(marker).exists() and recorded.is_file() and _words(recorded.read_text()) == _words(wanted)

    def stage(self, name: str, marker: str, command: Command) -> None:
        """Run `command` unless `marker` exists and the recorded command is this one."""
        wanted = self.record(command.shown)
        if self.up_to_date(name, marker, wanted):
            print(f"== {name}: up to date ({marker}), skipped", flush=True)
            return
        print(f"== {name}: {wanted}", flush=True)
        self._timed(name, lambda: _run(name, command))
        self._recorded(name).write_text(wanted + "\n")

    def always(self, name: str, title: str, command: Command) -> None:
        """Run `command` every time (it resumes itself, as eval does); record it afterwards."""
        print(f"== {title} (resumes where it stopped): {shlex.join(command.shown)}", flush=True)
        self._timed(name, lambda: _run(name, command))
        self._recorded(name).write_text(self.record(command.shown) + "\n")

    def step(self, name: str, marker: str, description: str, work: Callable[[], None]) -> None:
        """An in-process stage (a function of this package): as `stage`, `description` standing for its command."""
        wanted = description.replace(self.out, self.final)
        if self.up_to_date(name, marker, wanted):
            print(f"== {name}: up to date ({marker}), skipped", flush=True)
            return
        print(f"== {name}: {wanted}", flush=True)
        self._timed(name, work)
        self._recorded(name).write_text(wanted + "\n")

    def _timed(self, name: str, work: Callable[[], None]) -> None:
        began = time.monotonic()
        work()
        seconds = int(time.monotonic() - began)
        times = Path(self.out) / "stages.csv"
        if not times.is_file():
            times.write_text("stage,seconds\n")
        with times.open("a") as handle:
            handle.write(f"{name},{seconds}\n")
        print(f"== {name} took {seconds} s", flush=True)

    def carry(self, folders: Sequence[str]) -> None:
        """Copy each folder another target made in the earlier output into this one, unchanged."""
        for kept in folders:
            source, target = Path(self.final) / kept, Path(self.out) / kept
            if source.is_dir() and not target.exists():
                shutil.copytree(source, target, symlinks=True)
                print(f"== {kept}: kept from {self.final} (made by another target)", flush=True)

    def finish(self) -> None:
        """Remove every lock, move the earlier output aside and put the staging folder in its place."""
        for lock in Path(self.out).rglob(".lock"):
            if lock.is_file():
                lock.unlink()
        final = Path(self.final)
        if final.exists():
            previous = Path(PREVIOUS) / f"previous-{final.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            shutil.move(final, previous)
            print(f"== earlier outputs of {self.final} moved to {previous}", flush=True)
        self._point_records_at_final()
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(self.out, final)
        print(f"== done in {int(time.monotonic() - self.began)}s: see {self.final}/README.md", flush=True)

    def _point_records_at_final(self) -> None:
        """An eval's config.json and page, the predictors table, name the files they read (allocation, route,
        profiles) where they lay while the stage ran, inside the staging folder that is about to become the output:
        point those paths at the output instead, so the records name files that exist (as the recorded commands do)."""
        staged = (os.path.abspath(self.out), self.out)  # as a stage given an absolute or a relative path wrote it
        for record in (path for path in Path(self.out).rglob("*") if path.suffix in RECORDS and path.is_file()):
            text = record.read_text()
            moved = text
            for path in staged:
                moved = moved.replace(path + "/", self.final + "/")
            if moved != text:
                record.write_text(moved)


def _run(name: str, command: Command) -> None:
    process = subprocess.Popen(list(command.argv))
    try:
        code = process.wait()
    except KeyboardInterrupt:  # the stage got the same Ctrl-C: let it keep what it finished, then stop
        process.wait()
        raise
    if code != 0:
        raise StageFailed(name, code)
