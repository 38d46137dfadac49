"""`ripplekv lm-eval ...`: lm-evaluation-harness's own command line with the `ripplekv` backend registered.

lm-eval 0.4.13 loads a backend only from its own registry (no entry points, no `--plugins`), so a plain
`lm_eval --model ripplekv` cannot find ours; this command registers it, checks the method and budget of
`--model_args` (a mistake is one line, before lm-eval loads anything), and hands every argument to lm-eval.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ripplekv.errors import UserError

LM_EVAL_SETTINGS = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []}}


def lm_eval_command(ctx: typer.Context) -> None:
    """Run an lm-evaluation-harness evaluation under a compressed KV cache: every argument is lm-eval's
    (`--tasks`, `--include_path`, `--output_path`, `--limit`, ...); `--model` defaults to ripplekv and
    `--model_args` takes model=PATH (default: the bundled model), method=SPEC, budget=B, allocation=CSV.
    Needs the extra: pip install 'ripplekv[lm-eval]'."""
    args = list(ctx.args)
    try:
        from lm_eval.__main__ import cli_evaluate
        from lm_eval._cli import HarnessCLI

        from ripplekv.lm_eval_backend import BACKEND_NAME, check_model_args
    except ImportError as err:
        raise UserError(f"lm-eval is not installed ({err}); install the extra: pip install 'ripplekv[lm-eval]'") from None
    if any(arg in ("-h", "--help") for arg in args):
        sys.argv = ["lm-eval", "run", "--help"]
        cli_evaluate()
        return
    if not any(arg in ("--model", "-M") or arg.startswith(("--model=", "-M=")) for arg in args):
        args = ["--model", BACKEND_NAME, *args]
    # lm-eval's own parser reads the arguments (its model_args forms: a=1,b=2 / a=1 b=2 / JSON / repeated)
    parsed = HarnessCLI()._parser.parse_args(["run", *args])
    include = getattr(parsed, "include_path", None)
    if include is not None and not Path(include).is_dir():
        raise UserError(f"--include_path {include} is not a folder; pass the folder that holds the task YAML files")
    sys.argv = ["lm-eval", "run", *args]
    try:
        if parsed.model == BACKEND_NAME:
            check_model_args(parsed.model_args or {})
        cli_evaluate()
    except UserError as err:  # the backend's settings are --model_args keys here, not ripplekv's flags
        raise UserError(err.phrased(model_arg)) from None
    except ValueError as err:
        if not str(err).startswith("Tasks not found"):
            raise
        raise UserError(f"lm-eval: {err}; list them with `lm-eval ls tasks`, or pass --include_path with the folder "
                        "of your own task YAML files") from None
    except FileNotFoundError as err:  # a task's data file, which lm-eval reads relative to where it runs
        raise UserError(f"lm-eval: {err}; a task's data_files path is read relative to the folder lm-eval runs in "
                        f"({Path.cwd()}): run from the folder it is relative to (the checkout's root for "
                        "examples/lm_eval) or make the path absolute") from None


def model_arg(setting: str) -> str:
    """How `--model_args` spells a setting the libraries name in a message (`errors.UserError`)."""
    return f"model_args {setting}="
