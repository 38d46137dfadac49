"""Safe outputs: locations checked before any work, atomic writes, and per-unit logs for resuming.

- `check_output` runs before a command computes anything: the location must be creatable and
  writable, of the right kind (file or directory), and never one of the command's inputs.
- Every CSV/JSON/PNG/text output is written to a temporary file beside it, fsynced, then renamed
  over the target (`os.replace`), so a crash or kill never leaves a half-written file where a good
  one was.
- `UnitLog` is an append-only JSON-lines file: a header line with the settings, then one fsynced line
  per finished unit (a sample). A killed run loses at most the unit in flight; a rerun with the same
  settings skips what is logged.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

from ripplekv.errors import UserError, write_failure
from ripplekv.runs.files import RUNS, run_kind
from ripplekv.runs.jsonl import read_jsonl


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(path: str | Path, *, kind: str = "file", inputs: Iterable = (), writes: Iterable[str] = (),
                 option: str = "--out", run: str | None = None) -> Path:
    """Fail with one line unless `path` can be written as a `kind` ('file' or 'dir') without touching
    an input or another run's files. For a directory, `writes` names the files the command puts in it
    and `run` the kind of run folder it makes (`runs.files.RUNS`); a run folder of another kind, and any
    file inside one, is never written."""
    path = Path(path).expanduser()
    inputs = [Path(p).expanduser() for p in inputs if p is not None]
    targets = [path] if kind == "file" else [path / name for name in writes]
    for target in targets:
        for source in inputs:
            if _same(target, source):
                raise UserError(f"{option} {path} would overwrite the input {source}; write to another path")
    if kind == "file" and path.is_dir():
        raise UserError(f"{option} {path} is a directory; pass a file path")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise UserError(f"{option} {path} is a file; pass a directory")
    _check_owner(path, kind, run, option)
    existing = path if kind == "dir" else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{option} {path} cannot be created: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(f"{option} {path} cannot be written ({err.strerror or err} in {existing}); "
                        "pick a writable location") from None
    return path


def _check_owner(path: Path, kind: str, run: str | None, option: str) -> None:
    """A file output inside any run folder, or a folder output that is a run of another kind, belongs
    to that run: refused, so that no command overwrites (or adds to) another command's record."""
    if kind == "file":
        owner = run_kind(path.parent)
        if owner is not None:
            raise UserError(f"{option} {path} is inside {path.parent}, which holds {RUNS[owner][0]}; "
                            "write outside that folder")
        return
    owner = run_kind(path)
    if owner is not None and owner != run:
        wanted = f", not {RUNS[run][0]}" if run in RUNS else ""
        raise UserError(f"{option} {path} holds {RUNS[owner][0]}{wanted}; pass a new or empty directory")


def other_files(folder: Path, own: Iterable[str]) -> list[str]:
    """Names in `folder` that the command does not write itself (hidden files ignored)."""
    if not folder.is_dir():
        return []
    own = set(own)
    return sorted(p.name for p in folder.iterdir() if p.name not in own and not p.name.startswith("."))


def open_append(path: Path):
    """`path` opened for appending bytes (`append_bytes`), or the one-line error."""
    try:
        return Path(path).open("ab")
    except OSError as err:
        raise write_failure(path, err) from None


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path` in one step."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:
        _discard(tmp)
        raise write_failure(path, err) from None
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:  # a read-only file system: there is nothing to remove
        pass


def cut_to(path: Path, length: int) -> None:
    """Cut a file back to its first `length` bytes, fsynced (a torn last record after a kill); a failure is the
    one-line error that names the file."""
    try:
        with Path(path).open("r+b") as fh:
            fh.truncate(length)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        raise write_failure(path, err, "rerun the same command") from None


def append_bytes(handle, data: bytes) -> None:
    """Append `data` to an open file in one fsynced step: on a failure (a full disk) the file is cut back
    to where it was, so it never ends in part of a record, and the one-line error names it."""
    handle.flush()
    fd = handle.fileno()
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as err:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise write_failure(handle.name, err) from None


def write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, data) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_csv(path: str | Path, frame, **kwargs) -> None:
    """A pandas DataFrame as CSV (`index=False` unless given)."""
    kwargs.setdefault("index", False)
    atomic_write(path, lambda tmp: frame.to_csv(tmp, **kwargs))


def save_figure(fig, path: str | Path, **kwargs) -> None:
    """A matplotlib figure; the format follows the target's suffix, not the temporary name.

    After `tight_layout` a figure keeps a placeholder layout engine, and savefig then draws it once without
    rendering before the real draw; dropping the placeholder skips that draw (the same pixels: it only laid
    out text again). Kept where savefig needs the first draw to measure (`bbox_inches="tight"`)."""
    from matplotlib.layout_engine import PlaceHolderLayoutEngine

    path = Path(path)
    if kwargs.get("bbox_inches") != "tight" and isinstance(fig.get_layout_engine(), PlaceHolderLayoutEngine):
        fig.set_layout_engine(None)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **kwargs))


@contextmanager
def exclusive(folder: Path, what: str, elsewhere: str | None = "use another --out"):
    """Hold `folder/.lock` while writing: two runs appending to one log would duplicate lines. The holder
    writes its command and pid into the lock, so a refused command names who holds it; `elsewhere` is
    the other way out the refused command offers (None: it has no --out, it can only wait). An output that is a
    file is said to be one, never taken for a lock another run holds."""
    clash = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if clash is not None:
        raise UserError(f"{clash} is a file, not a folder: {what} writes a folder there; "
                        f"{elsewhere or 'move the file away'}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = (folder / ".lock").open("a+")
    except OSError as err:
        raise write_failure(folder / ".lock", err, "rerun the same command") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().split()
        handle.close()
        who = f"another ripplekv {holder[0]}" if holder else f"another ripplekv {what}"
        pid = f" (pid {holder[1]})" if len(holder) > 1 else ""
        raise UserError(f"{who} is writing to {folder}{pid}; wait for it to finish"
                        f"{f' or {elsewhere}' if elsewhere else ''}") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{what} {os.getpid()}\n")
        handle.flush()
    except OSError:  # the lock holds without its note
        pass
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def setting_difference(key: str, old: dict, new: dict) -> str:
    """A setting that differs between a saved run and a new command, with both values when they are plain
    (e.g. a default that changed since the run was made: `batch_size (16 there, 32 now)`), so the user can
    pass the run's own."""
    plain = (int, float, str, bool, type(None))
    if key in old and key in new and isinstance(old[key], plain) and isinstance(new[key], plain):
        return f"{key} ({old[key]!r} there, {new[key]!r} now)"
    return key


class UnitLog:
    """Append-only JSON lines: `{"settings": ...}` first, then `{"key": ..., "value": ...}` per finished unit.

    Opening it with other settings than the logged ones raises a UserError (`restart=False`) or starts
    the log afresh (`restart=True`, for scratch logs the user never sees as results).
    """

    def __init__(self, path: Path, settings: dict, *, restart: bool = False, remedy: str = "use a new --out"):
        self.path, self.settings = Path(path), json.loads(json.dumps(settings))
        self.done: dict[str, object] = {}
        lines, partial = self._read()
        if lines and lines[0].get("settings") != self.settings:
            if not restart:
                old = lines[0].get("settings") or {}
                differing = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
                raise UserError(f"{self.path.parent} holds results of other settings (differs in: "
                                f"{', '.join(setting_difference(k, old, self.settings) for k in differing) or 'format'}); "
                                f"{remedy}, or rerun with the same options to resume")
            lines, partial = [], True
        for line in lines[1:]:
            self.done[line["key"]] = line["value"]
        if not lines or partial:  # start the file (again), keeping only whole lines
            body = [{"settings": self.settings}] + [{"key": k, "value": v} for k, v in self.done.items()]
            atomic_write(self.path, lambda tmp: tmp.write_text("".join(json.dumps(x) + "\n" for x in body)))

    def _read(self) -> tuple[list[dict], bool]:
        """Whole lines of the log and whether anything after them (a kill mid-write) was dropped."""
        read = read_jsonl(self.path, remedy="delete it to start over")
        lines = read.objects
        if any("key" not in line for line in lines[1:]):
            raise UserError(f"{self.path} was not written by ripplekv; delete it to start over")
        return lines, bool(read.torn)

    def append(self, key: str, value) -> None:
        with open_append(self.path) as handle:
            append_bytes(handle, (json.dumps({"key": key, "value": value}) + "\n").encode("utf-8"))
        self.done[key] = value
