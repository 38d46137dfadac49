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
    if parsed.model == BACKEND_NAME:
        check_model_args(parsed.model_args or {})
    sys.argv = ["lm-eval", "run", *args]
    cli_evaluate()
