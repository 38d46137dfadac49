"""A resumed eval gives an uninterrupted run's numbers: a sample's decoding groups (and so its float32 results,
which depend on what shares a batch) are a function of the sample alone, never of the process's history
(what the resident set holds after earlier samples, or a fresh process after a resume); and a sample whose
lines were written but whose timings row was not (kill -9 between the two) keeps its seconds."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ripplekv.engine import memory
from tests.conftest import without_peak_memory
from tests.test_disk_full import fail_writes

ARGS = ["eval", "--suite", "offline", "--tasks", "niah,squad", "--limit", "1", "--target-tokens", "300",
        "--methods", "snapkv,streamingllm,h2o", "--budget", "16,64", "--batch-size", "6", "--memory-budget", "90MB"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from ripplekv.engine.models import load_model

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    return model, tokenizer


def one_sample(loaded, memory_budget: int, monkeypatch, grown_by: int = 0) -> tuple[list[dict], list[list[int]]]:
    """evaluate_sample on one niah prompt; the sample's measured growth (resident set) raised by `grown_by`,
    as in a process whose earlier work left more resident; returns its rows and its decoding groups."""
    from ripplekv.engine import decode
    from ripplekv.methods import make_method
    from ripplekv.pipeline import evaluate
    from ripplekv.tasks import get_tasks, load_samples

    model, tokenizer = loaded
    task = get_tasks("offline", ["niah"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=256)[0]
    methods = {name: make_method(name) for name in ("full", "snapkv", "streamingllm", "h2o")}
    sizes: list[list[int]] = []
    plan = memory.plan_groups

    def recorded(*args, **kwargs):
        groups = plan(*args, **kwargs)
        sizes.append([len(group) for group in groups])
        return groups

    real_grown = memory.PeakMemory.grown
    with monkeypatch.context() as patch:
        patch.setattr(decode, "plan_groups", recorded)
        patch.setattr(memory.PeakMemory, "grown", lambda self: real_grown(self) + grown_by)
        rows = evaluate.evaluate_sample(model, tokenizer, task, record, methods, (16, 96),
                                        evaluate.SampleSettings(memory_budget=memory_budget), sid="s")
    return rows, sizes


def test_a_samples_groups_and_numbers_do_not_depend_on_what_the_process_holds(loaded, monkeypatch):
    """Under a bound that binds, a process holding 40 MiB more (earlier samples, lazy library state) plans the
    same groups, so the same text and bit-identical KL: the plan reads the sample's own tensors, not the
    resident set."""
    from ripplekv.engine import schedule

    real = memory.variant_room
    seen = {}

    def capture(model, state, reference, labels, lengths, methods, budget, prefix, max_new_tokens):
        room = real(model, state, reference, labels, lengths, methods, budget, prefix, max_new_tokens)
        fed = max(1, prefix + len(reference.tokens) - 1)
        costs = memory.StepCosts.of(model, state)
        seen["alone"] = max(costs.group(1, length, fed, fed + max_new_tokens) for length in lengths)
        seen["fixed"] = budget - room
        return room

    with monkeypatch.context() as patch:
        patch.setattr(schedule, "variant_room", capture)
        free, free_groups = one_sample(loaded, 2**40, monkeypatch)
    budget = seen["fixed"] + 2 * seen["alone"]  # room for two variants a group, not for all six
    quiet, quiet_groups = one_sample(loaded, budget, monkeypatch)
    busy, busy_groups = one_sample(loaded, budget, monkeypatch, grown_by=40 * 2**20)
    assert quiet_groups != free_groups, "the bound did not bind"
    assert busy_groups == quiet_groups
    for a, b in zip(quiet, busy):
        assert (a["method"], a["budget"], a["prediction"], a["kl"], a["agreement"]) == \
            (b["method"], b["budget"], b["prediction"], b["kl"], b["agreement"])


def numbers(folder: Path) -> list[tuple]:
    """Each line's identity, text and KL, in file order."""
    rows = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    return [(r["task"], r["id"], r["method"], r["budget"], r["prediction"], r["kl"]) for r in rows]


def run_eval_process(args: list[str], kill_at_timing: int | None = None) -> subprocess.CompletedProcess:
    """`ripplekv eval` in a fresh interpreter (a resume starts one); with `kill_at_timing` k, the process
    kills itself with SIGKILL right after the k-th sample's lines are on disk, before its timings row."""
    hook = ""
    if kill_at_timing is not None:
        hook = ("from ripplekv.runs import timings as t\n"
                "real = t.TimingsLog.append\n"
                "calls = []\n"
                "def append(self, task, sid, spent):\n"
                f"    calls.append(sid)\n"
                f"    if task and len(calls) == {kill_at_timing}:\n"
                "        os.kill(os.getpid(), signal.SIGKILL)\n"
                "    return real(self, task, sid, spent)\n"
                "t.TimingsLog.append = append\n")
    code = ("import os, signal, sys\n" + hook +
            "from ripplekv.cli import app\n"
            "sys.argv = ['ripplekv', *sys.argv[1:]]\n"
            "app.main()\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = run_eval_process([*ARGS, "--model", str(tiny_model_dir), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    return out


def test_kill_9_between_a_samples_lines_and_its_timings_resumes_to_the_same_numbers(uninterrupted, tiny_model_dir,
                                                                                    tmp_path):
    """Killed after the first sample's lines, before its timings row: the second sample then runs first in a
    fresh process, yet every line equals the uninterrupted run's; the first sample's seconds, staged before its
    lines, are in the table after the resume, and the report counts both samples as timed."""
    out = tmp_path / "run"
    args = [*ARGS, "--model", str(tiny_model_dir), "--out", str(out)]
    killed = run_eval_process(args, kill_at_timing=1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert numbers(out) == numbers(uninterrupted)[: len(numbers(out))] and numbers(out)
    done = run_eval_process(args)
    assert done.returncode == 0, done.stderr
    assert without_peak_memory((out / "predictions.jsonl").read_text()) == \
        without_peak_memory((uninterrupted / "predictions.jsonl").read_text())
    summary = (out / "summary.md").read_text()
    samples = {(r[0], r[1]) for r in numbers(out)}
    assert len(samples) == 2
    assert "over the 2 samples timed" in summary and "not timed" not in summary, summary
    from ripplekv.runs.timings import UNTIMED, read_timings

    timed = read_timings(out / "timings.csv")
    assert set(zip(timed["task"], timed["sample_id"])) - {("", "")} == samples  # every sample has its rows
    assert UNTIMED not in set(timed["phase"])


@pytest.mark.parametrize("skip", [0, 1])
def test_a_full_disk_at_a_later_sample_resumes_to_the_same_numbers(uninterrupted, tiny_model_dir, tmp_path, run_cli,
                                                                   monkeypatch, skip):
    """predictions.jsonl fills up at its first and its second sample (half a write on disk); with room again the
    rerun's lines equal the uninterrupted run's, text and KL."""
    out = tmp_path / "run"
    args = [*ARGS, "--model", str(tiny_model_dir), "--out", str(out)]
    with monkeypatch.context() as patch:
        fail_writes(patch, "predictions.jsonl", errno.ENOSPC, skip, torn=True)
        status, _, err = run_cli(*args)
    assert status == 2 and "no space is left" in err, err
    status, _, err = run_cli(*args)
    assert status == 0, err
    ours, theirs = numbers(out), numbers(uninterrupted)
    assert [r[:5] for r in ours] == [r[:5] for r in theirs]
    assert all(abs(a[5] - b[5]) <= 1e-6 for a, b in zip(ours, theirs))
