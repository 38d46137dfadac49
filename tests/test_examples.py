"""The examples users copy catch `ripplekv.UserError` and print its one line, exit 2, as the CLI does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script, args, message", [
    ("compare_methods.py", ["--methods", "nosuch"], "nosuch"),
    ("compare_methods.py", ["/nowhere/story.txt"], "cannot read the text file /nowhere/story.txt"),
    ("compare_methods.py", ["--budget", "0"], "budget"),
    ("compress_and_generate.py", ["--budget", "0"], "budget"),
])
def test_an_example_given_a_mistake_prints_one_line_and_exits_2(script, args, message):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
