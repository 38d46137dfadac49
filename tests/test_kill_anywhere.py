"""A run killed at any point between the writes of a sample resumes to consistent files: the uninterrupted
run's predictions and report, the sample timed once, nothing staged left behind.

The kill is simulated in-process before each step a run takes on predictions.jsonl, timings.csv and what is
staged beside them (`os.write`, `os.replace`, `os.unlink`; a write also torn in half): `Killed` is no
`Exception`, so nothing after the step runs but the unwinding of `with` blocks. (A process killed just before an
`os.fsync` leaves what one killed just after the write leaves: the fsyncs are recorded, not killed at.) What is
under test is the writing, so the killed and resumed runs replay the uninterrupted run's computed lines and
seconds instead of computing them again (`replayed`).
"""

from __future__ import annotations

import os

import pytest

from ripplekv.analysis.time_spent import samples_timed
from ripplekv.runs.timings import UNTIMED, read_timings
from tests.conftest import run_files

ARGS = ["eval", "--suite", "offline", "--tasks", "niah", "--limit", "1", "--target-tokens", "300",
        "--methods", "snapkv", "--budget", "32", "--batch-size", "4"]
WATCHED = ("predictions.jsonl", "timings.csv", ".timings.pending.json")


class Killed(BaseException):
    """A kill -9 at this step."""


def watched(path) -> str | None:
    """The watched run file `path` is (or its temporary twin), else None."""
    name = os.path.basename(str(path))
    return next((w for w in WATCHED if name in (w, f".{w}.tmp")), None)


def steps(monkeypatch, kill_at: int | None = None, torn: bool = False) -> list[tuple[str, str]]:
    """Record each durable step on a watched file as (call, file); at step `kill_at` (0-based) raise `Killed`
    before it, or, `torn` and the step a write, after half of its bytes are on disk."""
    real = {name: getattr(os, name) for name in ("write", "fsync", "replace", "unlink")}
    seen: list[tuple[str, str]] = []

    def of_fd(fd):
        try:
            return watched(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return None

    def step(call: str, target: str | None, *args):
        if target is not None:
            seen.append((call, target))
            if len(seen) - 1 == kill_at:
                if torn and call == "write":
                    real["write"](args[0], bytes(args[1])[: len(args[1]) // 2])
                raise Killed(f"{call} {target}")
        return real[call](*args)

    monkeypatch.setattr(os, "write", lambda fd, data: step("write", of_fd(fd), fd, data))
    monkeypatch.setattr(os, "fsync", lambda fd: step("fsync", of_fd(fd), fd))
    monkeypatch.setattr(os, "replace", lambda src, dst, **kw: step("replace", watched(dst), src, dst, **kw))
    monkeypatch.setattr(os, "unlink", lambda path, **kw: step("unlink", watched(path), path, **kw))
    return seen


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run, the steps it took on the watched files, and what its sample computed."""
    from ripplekv.pipeline import evaluate
    from tests.conftest import invoke

    out = tmp_path_factory.mktemp("reference") / "run"
    computed = {}
    real = evaluate.run_samples

    def recorded(*args, **kwargs):
        for job, result in real(*args, **kwargs):
            computed[(job.task.name, job.sid)] = result
            yield job, result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate, "run_samples", recorded)
        seen = steps(patch)
        done = invoke(*ARGS, "--model", tiny_model_dir, "--out", out)
    assert done.returncode == 0, done.stderr
    return out, seen, computed


def replayed(monkeypatch, computed: dict) -> None:
    """Each job of a run yields what the uninterrupted run computed for its sample."""
    from ripplekv.pipeline import evaluate

    def replay(plan, jobs, *args, **kwargs):
        for job in jobs:
            yield job, computed[(job.task.name, job.sid)]

    monkeypatch.setattr(evaluate, "run_samples", replay)


def kill_points(seen: list[tuple[str, str]]) -> list[tuple[int, bool]]:
    """Every step but the fsyncs, up to the report's own timings row (its last two steps); writes also torn."""
    assert seen[-2:] == [("write", "timings.csv"), ("fsync", "timings.csv")]  # the report's row
    return [(i, torn) for i in range(len(seen) - 2) if seen[i][0] != "fsync"
            for torn in ((False, True) if seen[i][0] == "write" else (False,))]


@pytest.mark.slow
def test_the_kill_points_cover_both_files_of_a_sample(reference):
    """The steps killed at include the gap the issue names: a sample's lines on disk, its timings not."""
    _, seen, _ = reference
    points = [seen[i] for i, _ in kill_points(seen)]
    assert points.index(("write", "predictions.jsonl")) < points.index(("write", "timings.csv"))


@pytest.mark.slow
def test_a_kill_at_any_step_resumes_to_consistent_files(reference, tiny_model_dir, tmp_path, run_cli, monkeypatch):
    done, seen, computed = reference
    expected = run_files(done)
    replayed(monkeypatch, computed)
    for number, (at, torn) in enumerate(kill_points(seen)):
        out = tmp_path / f"run{number}"
        args = [*ARGS, "--model", tiny_model_dir, "--out", out]
        where = f"killed at {seen[at]}{' (torn)' if torn else ''}"
        with monkeypatch.context() as patch:
            steps(patch, kill_at=at, torn=torn)
            with pytest.raises(Killed):
                run_cli(*args)
        code, _, err = run_cli(*args)
        assert code == 0, (where, err)
        assert run_files(out) == expected, where  # predictions, config and every report file (summary's counts)
        assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"], where
        rows = read_timings(out / "timings.csv")
        samples = rows[rows["sample_id"] != ""]
        assert UNTIMED not in set(samples["phase"]), where
        assert samples.groupby(["task", "sample_id"])["job"].max().tolist() == [1], where  # timed once
        assert not samples.duplicated(["task", "sample_id", "phase", "method"]).any(), where
        assert samples_timed(out) == (1, 0), where
