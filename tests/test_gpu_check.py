"""scripts/gpu_check.py: its small equalities hold here on CPU, and without CUDA the GPU run is one line."""

import json

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA line")
def test_without_cuda_it_says_so_in_one_line(gpu_check, capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path / "g.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA" in out and not (tmp_path / "g.json").exists()


def test_the_small_equalities_hold_on_cpu(gpu_check, tmp_path):
    assert gpu_check.main(["--small-only", "--out", str(tmp_path / "g.json")]) == 0
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["pass"] and len(report["checks"]) >= 4
    assert all({"check", "pass", "value", "threshold"} <= set(one) for one in report["checks"])
