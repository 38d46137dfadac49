"""A full disk, a spent quota or a read-only file system at any writer of a run (predictions, config,
reports, plots, unit logs, the dequantized-model cache) ends in one line that names the path and what to
do, exit 2; nothing written is torn, and the rerun with room gives the uninterrupted run's files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ripplekv.errors import UserError
from tests.conftest import run_files, without_peak_memory

ARGS = ["eval", "--suite", "offline", "--tasks", "niah,squad", "--limit", "1", "--target-tokens", "300",
        "--methods", "snapkv,streamingllm", "--budget", "32", "--batch-size", "4"]


@pytest.fixture(autouse=True, scope="module")
def eval_figures():
    """Figures are among the writers under test here: eval draws them in this file."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIPPLEKV_PLOTS", "1")
        yield


def files(folder: Path) -> dict[str, bytes]:
    return run_files(folder)


def fail_writes(monkeypatch, name: str, code: int, skip: int = 0, torn: bool = False) -> list:
    """Writes to the file `name` (or its temporary twin) fail with `code` after `skip` good writes; with
    `torn`, the failing write first puts half of its bytes on disk, as a disk filling mid-write does."""
    real_write, real_fsync, seen = os.write, os.fsync, []

    def target(fd) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return os.path.basename(path) in (name, f".{name}.tmp")

    def write(fd, data):
        if target(fd):
            seen.append(len(data))
            if len(seen) > skip:
                if torn and len(seen) == skip + 1:
                    return real_write(fd, bytes(data)[: len(data) // 2])
                raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    def fsync(fd):
        if target(fd) and len(seen) >= skip and name != "predictions.jsonl":
            seen.append(0)
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    from tests.conftest import invoke

    out = tmp_path_factory.mktemp("full-disk") / "reference"
    result = invoke(*ARGS, "--model", tiny_model_dir, "--out", out)
    assert result.returncode == 0, result.stderr
    return files(out)


@pytest.mark.parametrize("name, code, skip, torn", [
    ("predictions.jsonl", errno.ENOSPC, 1, True),  # the second sample's lines, half written
    ("config.json", errno.EROFS, 0, False),
    ("leaderboard.csv", errno.ENOSPC, 0, False),
    ("score_vs_budget.png", errno.EDQUOT, 0, False),
])
@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_rerun_resumes(reference, tiny_model_dir, tmp_path, run_cli, monkeypatch,
                                                        name, code, skip, torn):
    out = tmp_path / "run"
    args = [*ARGS, "--model", str(tiny_model_dir), "--out", str(out)]
    with monkeypatch.context() as patch:
        seen = fail_writes(patch, name, code, skip, torn)
        status, _, err = run_cli(*args)
    assert seen, f"no write to {name} was attempted: {err}"
    assert status == 2, err
    last = err.strip().splitlines()[-1]  # after the run's progress lines
    assert last.startswith("error: cannot write ") and err.count("error:") == 1 and "Traceback" not in err, err
    assert str(out / name) in last and "another --out" in err and "rerun the same command" in err, err
    predictions = out / "predictions.jsonl"
    if predictions.is_file():  # whole samples only: never a torn line
        data = without_peak_memory(predictions.read_bytes())
        assert data == reference["predictions.jsonl"][: len(data)] and (not data or data.endswith(b"\n"))
    status, _, err = run_cli(*args)
    assert status == 0, err
    assert files(out) == reference


def test_a_full_unit_log_is_one_line_and_keeps_its_lines(tmp_path, monkeypatch):
    from ripplekv.runs.safeio import UnitLog

    log = UnitLog(tmp_path / "samples.jsonl", {"eta": 0.3})
    log.append("a", [1.0])
    before = log.path.read_bytes()
    with monkeypatch.context() as patch:
        fail_writes(patch, "samples.jsonl", errno.ENOSPC, torn=True)
        with pytest.raises(UserError, match="no space is left on its device; free space there"):
            log.append("b", [2.0] * 1000)
    assert log.path.read_bytes() == before
    assert UnitLog(log.path, {"eta": 0.3}).done == {"a": [1.0]}


def test_a_full_model_cache_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch, tokenizer):
    """Dequantizing a GGUF into a full cache: one line naming the cache and RIPPLEKV_CACHE, no partial folder."""
    import safetensors.torch
    import transformers
    from safetensors import SafetensorError

    from ripplekv.engine import models
    from tests.conftest import tiny_llama

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: tiny_llama(vocab_size=len(tokenizer)))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    source = models.ModelSource("gguf", str(tmp_path / "m.gguf"), "m")
    with pytest.raises(UserError) as caught:
        models._materialize_gguf(source)
    message = str(caught.value)
    assert "model.safetensors: no space is left on its device" in message and "RIPPLEKV_CACHE" in message, message
    assert not list((tmp_path / "cache").rglob("*.partial")), "a partial model folder was left"
    assert not list((tmp_path / "cache").rglob(".complete"))
