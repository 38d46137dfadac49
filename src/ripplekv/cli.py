"""The `ripplekv` command line: one Typer app, one command per pipeline stage.

User mistakes raise `UserError`; `main` turns them into one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

import typer

from ripplekv.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Benchmark KV-cache compression methods under exactly matched budgets.",
)


# --- commands: budgets (engine) ---

# --- commands: profile, allocate ---

# --- commands: eval, report ---

# --- commands: score ---

# --- commands: tasks ---


def main() -> None:
    """Entry point: run the app, turning user errors into one clear line and exit code 2."""
    try:
        app(standalone_mode=False)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # click usage errors carry their own exit code
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise
