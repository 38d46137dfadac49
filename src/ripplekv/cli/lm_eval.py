"""`ripplekv lm-eval ...`: lm-evaluation-harness's own command line with the `ripplekv` backend registered.

lm-eval 0.4.13 loads a backend only from its own registry (no entry points, no `--plugins`), so a plain
`lm_eval --model ripplekv` cannot find ours; this command registers it, checks the method and budget of
`--model_args` (a mistake is one line, before lm-eval loads anything), and hands every argument to lm-eval.
"""

from __future__ import annotations

import sys

import typer

from ripplekv.errors import UserError

LM_EVAL_SETTINGS = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []}}


def _option(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value of an lm-eval option (`--name X` or `--name=X`, any of `names`), or None when absent."""
    for index, arg in enumerate(args):
        if arg in names:
            if index + 1 >= len(args):
                raise UserError(f"{names[0]} needs a value")
            return args[index + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def lm_eval_command(ctx: typer.Context) -> None:
    """Run an lm-evaluation-harness evaluation under a compressed KV cache: every argument is lm-eval's
    (`--tasks`, `--include_path`, `--output_path`, `--limit`, ...); `--model` defaults to ripplekv and
    `--model_args` takes model=PATH (default: the bundled model), method=SPEC, budget=B, allocation=CSV.
    Needs the extra: pip install 'ripplekv[lm-eval]'."""
    args = list(ctx.args)
    try:
        from lm_eval.__main__ import cli_evaluate

        from ripplekv.lm_eval_backend import BACKEND_NAME, check_model_args
    except ImportError as err:
        raise UserError(f"lm-eval is not installed ({err}); install the extra: pip install 'ripplekv[lm-eval]'") from None
    if any(arg in ("-h", "--help") for arg in args):
        sys.argv = ["lm-eval", "run", "--help"]
        cli_evaluate()
        return
    if _option(args, ("--model", "-M")) is None:
        args = ["--model", BACKEND_NAME, *args]
    if _option(args, ("--model", "-M")) == BACKEND_NAME:
        check_model_args(_option(args, ("--model_args", "-a")) or "")
    sys.argv = ["lm-eval", "run", *args]
    cli_evaluate()
