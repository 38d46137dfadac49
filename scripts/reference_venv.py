"""The second venv the reference checks run kvpress and optimum-quanto in (`make check-references`, `make bench-peer`).

It lives in the project by default (`.refvenv/`, ignored by git), wherever the command runs from; `--venv`,
`RIPPLEKV_REFVENV` (or `REFVENV` with make) put it elsewhere. Its path is checked before anything is made
(`check_venv_path`: not under a file, in a writable folder); it is created when missing or broken: the same CPU
torch first, then the pins (`ensure_venv`); a failing step is one line, not a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

PINS = ("kvpress==0.5.5", "transformers==5.2.0", "optimum-quanto==0.2.7", "gguf", "accelerate")
TORCH = "torch==2.13.0"
DEFAULT_VENV = Path(__file__).resolve().parent.parent / ".refvenv"
PROBE = "import kvpress, transformers, torch, optimum.quanto; assert transformers.__version__ == '5.2.0'; assert '+cpu' in torch.__version__"


def default_venv() -> str:
    return os.environ.get("RIPPLEKV_REFVENV") or os.environ.get("REFVENV") or str(DEFAULT_VENV)


def venv_ready(venv: Path) -> bool:
    python = venv / "bin" / "python"
    return python.exists() and subprocess.run([str(python), "-c", PROBE], capture_output=True).returncode == 0


def check_venv_path(venv: str | Path) -> Path:
    """The reference venv's folder, checked before anything is created: an existing, working venv, or a path
    where one can be made (not under a file, in a writable folder). A UserError in one line otherwise."""
    from ripplekv.errors import UserError

    venv = Path(venv).expanduser()
    remedy = "pass --venv PATH (make: REFVENV=PATH) to a writable folder"
    if venv.exists() and not venv.is_dir():
        raise UserError(f"--venv {venv} is a file, not a folder for the reference venv; {remedy}")
    if venv_ready(venv):
        return venv
    existing = venv
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--venv {venv} cannot be created: {existing} is a file, not a folder; {remedy}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(f"--venv {venv} cannot be created: {existing} is not writable ({err.strerror or err}); "
                        f"{remedy}") from None
    return venv


def ensure_venv(venv: Path) -> Path:
    """The reference venv's python; created (CPU torch from the local wheel first, then the pins) when missing.
    Call `check_venv_path` first (before any other output is made); a step that fails is one UserError."""
    from ripplekv.errors import UserError

    venv = check_venv_path(venv)
    python = venv / "bin" / "python"
    if venv_ready(venv):
        return python
    print(f"creating the reference venv {venv} (torch CPU, {', '.join(PINS)})", file=sys.stderr)

    def step(*command, **kwargs):
        try:
            return subprocess.run([str(c) for c in command], check=True, **kwargs)
        except (OSError, subprocess.CalledProcessError) as err:
            raise UserError(f"creating the reference venv {venv} failed at `{' '.join(map(str, command[:4]))}` ({err}); "
                            "fix what its output above says (network or disk), or pass --venv PATH to a working "
                            "reference venv") from None

    step(os.environ.get("REFVENV_PYTHON", "python3.11"), "-m", "venv", venv)
    step(python, "-m", "pip", "install", "-q", TORCH)
    torch_version = step(python, "-c", "import torch; print(torch.__version__)", capture_output=True,
                         text=True).stdout.strip()
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")  # never let the resolver swap in a CUDA build
    step(python, "-m", "pip", "install", "-q", "-c", constraints, *PINS)
    step(python, "-c", PROBE)
    return python


def one_line(run) -> None:
    """Run `run()`; a UserError ends in one `error:` line and exit code 2 (what the ripplekv commands do)."""
    from ripplekv.errors import UserError

    try:
        run()
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        sys.exit(2)
