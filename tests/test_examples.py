"""The examples users copy catch `ripplekv.UserError` and print its one line, exit 2, as the CLI does.

Run in this process on the session's one load of the bundled model (a fresh interpreter per case loaded it
again before reaching the bad argument); one case that fails before any model work runs as a real process."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def one_error_line(stderr: str, message: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert "Traceback" not in stderr


def test_an_example_run_as_a_script_prints_one_line_and_exits_2():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(EXAMPLES / "compare_methods.py"), "/nowhere/story.txt"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr, "cannot read the text file /nowhere/story.txt")


@pytest.mark.slow
@pytest.mark.parametrize("script, args, message", [
    ("compare_methods.py", ["--methods", "nosuch"], "nosuch"),
    ("compare_methods.py", ["/nowhere/story.txt"], "cannot read the text file /nowhere/story.txt"),
    ("compare_methods.py", ["--budget", "0"], "budget"),
    ("compress_and_generate.py", ["--budget", "0"], "budget"),
])
def test_an_example_given_a_mistake_prints_one_line_and_exits_2(script, args, message, bundled_model, monkeypatch,
                                                                 capsys):
    from ripplekv import api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: bundled_model[:2])
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    one_error_line(err, message)
