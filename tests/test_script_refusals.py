"""The helper scripts refuse as the commands do: a mistake (an output under a file, bad --budgets, a reference venv
path that cannot be made) is one `error:` line, exit 2, checked before the model loads or anything (a venv, an
output folder) is made; the reference venv lives in the project by default. (`ripplekv fit compresskv`, once a
script, is checked in tests/test_fit_cli.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ripplekv.errors import UserError
from tests.conftest import load_script, script_refusal

REPO = Path(__file__).resolve().parents[1]


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


def test_an_output_folder_that_is_a_file_is_said_to_be_one_not_a_lock_clash(tmp_path):
    """The fitters (kvzap fit, LU-KV's profile) and every command hold `OUT/.lock` while they write: an OUT that
    is a plain file (or sits under one) is named as such, not reported as a lock it could not take."""
    from ripplekv.runs.safeio import exclusive

    (tmp_path / "a-file").write_text("x")
    for out in (tmp_path / "a-file", tmp_path / "a-file" / "fit"):
        with pytest.raises(UserError, match=r"a-file is a file, not a folder: kvzap fit writes a folder there; use "
                                            r"another --out$"):
            with exclusive(out, "kvzap fit"):
                pass
    assert (tmp_path / "a-file").read_text() == "x"
    with exclusive(tmp_path / "new" / "fit", "kvzap fit"):  # a missing folder is made, as before
        assert (tmp_path / "new" / "fit").is_dir()
