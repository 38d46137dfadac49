"""Interrupts lose at most the unit in flight: a real `ripplekv eval` killed (SIGINT or SIGKILL, sent to its own
process group) at three seeded points, then rerun, ends byte-identical to an uninterrupted run; profile and
allocate resume per calibration sample the same way."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ripplekv.errors import UserError
from ripplekv.pipeline import allocate, profile
from ripplekv.runs.safeio import UnitLog
from tests.conftest import run_files

TASKS, LIMIT = ("niah", "squad"), 2
VARIANTS = 1 + 2 * 2  # full + (snapkv, streamingllm) x 2 budgets


def eval_args(model: Path, out: Path) -> list[str]:
    return ["eval", "--model", str(model), "--suite", "offline", "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
            "--target-tokens", "300", "--methods", "snapkv,streamingllm", "--budget", "32", "--budget", "64",
            "--batch-size", "4", "--out", str(out)]


def files(folder: Path) -> dict[str, bytes]:
    return run_files(folder)


def complete_samples(out: Path) -> int:
    path = out / "predictions.jsonl"
    return path.read_bytes().count(b"\n") // VARIANTS if path.is_file() else 0


def kill_after(args: list[str], out: Path, samples: int, sig: int) -> subprocess.CompletedProcess:
    """Start `ripplekv` in its own process group; once `samples` samples are on disk, send `sig` to the group."""
    proc = subprocess.Popen([sys.executable, "-m", "ripplekv.cli.app", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (out / "config.json").is_file() and complete_samples(out) >= samples:
            os.killpg(proc.pid, sig)
            break
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_eval_killed_at_three_seeded_points_resumes_byte_identical(tiny_model_dir, tmp_path, run_cli):
    reference, out = tmp_path / "reference", tmp_path / "run"
    code, _, err = run_cli(*eval_args(tiny_model_dir, reference))
    assert code == 0, err
    total = len(TASKS) * LIMIT
    rng = random.Random(14)
    points = sorted(rng.sample(range(total), 3))
    kinds = [rng.choice((signal.SIGINT, signal.SIGKILL)) for _ in points]
    kinds[0] = signal.SIGINT  # at least one of each, whatever the seed
    kinds[-1] = signal.SIGKILL
    for samples, sig in zip(points, kinds):
        result = kill_after(eval_args(tiny_model_dir, out), out, samples, sig)
        if sig == signal.SIGINT and result.returncode != 0:
            assert result.returncode == 130, result.stderr
            assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("error:")
        assert complete_samples(out) <= total
    code, _, err = run_cli(*eval_args(tiny_model_dir, out))
    assert code == 0, err
    assert files(out) == files(reference)


@pytest.mark.slow
def test_profile_interrupted_after_one_sample_resumes_byte_identical(tiny_model_dir, tmp_path, run_cli, monkeypatch):
    args = ["profile", "--model", str(tiny_model_dir), "--calib-samples", "2", "--seeds", "1",
            "--target-tokens", "300"]
    code, _, err = run_cli(*args, "--out", str(tmp_path / "reference"))
    assert code == 0, err
    from ripplekv.pipeline import layer_kl

    real, calls = layer_kl.profile_prompt, []

    def interrupt_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(layer_kl, "profile_prompt", interrupt_second)
    out = tmp_path / "run"
    code, _, err = run_cli(*args, "--out", str(out))
    assert code == 130 and "interrupted" in err
    assert (out / profile.SAMPLES_LOG).read_text().count("\n") == 2  # header + the finished sample
    monkeypatch.setattr(layer_kl, "profile_prompt", real)
    code, _, err = run_cli(*args, "--out", str(out))
    assert code == 0, err
    assert files(out) == files(tmp_path / "reference")
    code, _, err = run_cli(*args, "--eta", "0.5", "--out", str(out))
    assert code == 2 and "differs in: eta (0.3 there, 0.5 now)" in err


@pytest.mark.slow
def test_allocate_sweep_interrupted_resumes_byte_identical(tiny_model_dir, tmp_path, run_cli, monkeypatch):
    sens = tmp_path / "sens.csv"
    sens.write_text("layer,kl_mean\n0,0.1\n1,0.4\n2,0.2\n3,0.3\n")
    args = ["allocate", str(sens), "--model", str(tiny_model_dir), "--ratio", "1", "--ratio", "4", "--budget", "32",
            "--calib-samples", "2", "--target-tokens", "300"]
    (tmp_path / "reference").mkdir()
    code, _, err = run_cli(*args, "--out", str(tmp_path / "reference" / "alloc.csv"))
    assert code == 0, err
    real, calls = allocate.UnitLog.append, []

    def interrupt_second(self, key, value):
        calls.append(key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(self, key, value)

    monkeypatch.setattr(allocate.UnitLog, "append", interrupt_second)
    out = tmp_path / "run"
    out.mkdir()
    code, _, err = run_cli(*args, "--out", str(out / "alloc.csv"))
    assert code == 130
    assert (out / ".alloc.sweep.jsonl").read_text().count("\n") == 2
    monkeypatch.setattr(allocate.UnitLog, "append", real)
    code, _, err = run_cli(*args, "--out", str(out / "alloc.csv"))
    assert code == 0, err
    assert files(out) == files(tmp_path / "reference")
    assert not (out / ".alloc.sweep.jsonl").exists()


def test_unit_log_drops_a_partial_line_and_refuses_other_settings(tmp_path):
    path = tmp_path / "log.jsonl"
    log = UnitLog(path, {"eta": 0.3})
    log.append("a", [1.5])
    with path.open("a") as handle:
        handle.write('{"key": "b", "val')  # killed mid-write
    again = UnitLog(path, {"eta": 0.3})
    assert again.done == {"a": [1.5]}
    assert path.read_text().endswith("[1.5]}\n")
    with pytest.raises(UserError, match="differs in: eta"):
        UnitLog(path, {"eta": 0.5})
    assert UnitLog(path, {"eta": 0.5}, restart=True).done == {}
    assert json.loads(path.read_text().splitlines()[0]) == {"settings": {"eta": 0.5}}
