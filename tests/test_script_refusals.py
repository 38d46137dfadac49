"""The helper scripts refuse as the commands do: a mistake (a zero budget or sample count, an output under a
file, bad --budgets, a reference venv path that cannot be made) is one `error:` line, exit 2, checked before the
model loads or anything (a venv, an output folder) is made; the reference venv lives in the project by default."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest

from ripplekv.errors import UserError
from tests.conftest import load_script, script_refusal

REPO = Path(__file__).resolve().parents[1]


def test_the_compresskv_profile_script_checks_everything_before_the_model(tmp_path, monkeypatch):
    profile = load_script("compresskv_profile")
    (tmp_path / "a-file").write_text("x")
    base = dict(model=None, calib_samples=2, budget=128, window=32, target_tokens=2000, out=str(tmp_path / "p.csv"),
                calib_draw=0, calib_draws=1)
    for change, message in ((dict(budget=0), "budget must be a positive integer"),
                            (dict(calib_samples=0), "--calib-samples must be at least 1"),
                            (dict(target_tokens=10), "--target-tokens must be"),
                            (dict(out=str(tmp_path / "a-file" / "p.csv")), "a-file is a file, not a directory")):
        with pytest.raises(UserError, match=message):
            profile.check(argparse.Namespace(**{**base, **change}))
    profile.check(argparse.Namespace(**{**base, "out": str(tmp_path / "missing" / "folder" / "p.csv")}))
    from ripplekv.methods.compresskv import write_profile

    write_profile(tmp_path / "missing" / "folder" / "p.csv", [0.5, 0.25])  # a missing folder is made, as commands do
    assert (tmp_path / "missing" / "folder" / "p.csv").read_text() == "layer,error\n0,0.5\n1,0.25\n"


def test_reference_scripts_refuse_bad_budgets_and_an_unusable_venv_before_making_anything(tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("x")
    err = script_refusal("check_references", "--budgets", "128,abc", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert err.strip() == "error: budget must be a positive integer, got 'abc'", err
    err = script_refusal("check_references", "--venv", tmp_path / "a-file" / "venv", cwd=tmp_path, monkeypatch=monkeypatch,
                  capsys=capsys)
    assert "a-file is a file, not a folder" in err and err.count("\n") == 1
    err = script_refusal("bench_peer", "--venv", tmp_path / "a-file", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert "is a file, not a folder" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no venv, no runs/ folder


def test_the_reference_venv_defaults_inside_the_project_and_is_ignored(monkeypatch):
    references = load_script("reference_venv")
    monkeypatch.delenv("RIPPLEKV_REFVENV", raising=False)
    monkeypatch.delenv("REFVENV", raising=False)
    assert Path(references.default_venv()) == REPO / ".refvenv"
    monkeypatch.setenv("RIPPLEKV_REFVENV", "/elsewhere/venv")
    assert references.default_venv() == "/elsewhere/venv"
    assert "/.refvenv/" in (REPO / ".gitignore").read_text().splitlines()
    make = subprocess.run(["make", "-n", "-o", ".venv/.installed", "check-references", "bench-peer"], cwd=REPO,
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k not in ("REFVENV", "RIPPLEKV_REFVENV")})
    assert make.stdout.count("--venv .refvenv") == 2 and "/work/refvenv" not in make.stdout, make.stdout
    moved = subprocess.run(["make", "-n", "-o", ".venv/.installed", "check-references", "REFVENV=/tmp/x"], cwd=REPO,
                           capture_output=True, text=True)
    assert "--venv /tmp/x" in moved.stdout
