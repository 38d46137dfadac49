"""The `ripplekv` command line: one Typer app, one command per pipeline stage.

User mistakes raise `UserError`; `main` turns them into one line on stderr and exit code 2, and prints each
`Notice` the libraries warn with as one `note:` line; both name a setting by its flag (`options.flag`).
The commands live in their own modules (listing, stages, fitting, evaluation, needle, inspecting, lm_eval); this module
registers them, in the order `ripplekv --help` lists them, so none of them imports the app.
"""

from __future__ import annotations

import sys
import warnings

import typer

from ripplekv.cli.evaluation import eval_command, report_command, score
from ripplekv.cli.fitting import fit_app
from ripplekv.cli.inspecting import inspect_command
from ripplekv.cli.listing import budgets, methods_command, tasks_command
from ripplekv.cli.lm_eval import LM_EVAL_SETTINGS, lm_eval_command
from ripplekv.cli.needle import needle_command
from ripplekv.cli.options import flag
from ripplekv.cli.reproducing import reproduce_command, study_command
from ripplekv.cli.screen import screen_command
from ripplekv.cli.stages import allocate, profile, route_command, tune
from ripplekv.errors import Notice, UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help: flags without a `<bool>` type, and defaults wrapped instead of cut off at the edge.
    rich_markup_mode=None,
    help="Benchmark KV-cache compression methods under exactly matched budgets.",
)


def _show_version(value: bool) -> None:
    if value:
        from ripplekv import __version__

        print(f"ripplekv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Benchmark KV-cache compression methods under exactly matched budgets."""


app.command()(budgets)
app.command()(profile)
app.command()(allocate)
app.command("route")(route_command)
app.command()(tune)
app.add_typer(fit_app, name="fit", short_help="Fit lukv, kvzap, fastkvzip, qfilter, compresskv or duoattention on calibration prompts.")
app.command("eval")(eval_command)
app.command("report")(report_command)
app.command("score")(score)
app.command("needle")(needle_command)
app.command("screen")(screen_command)
app.command("inspect")(inspect_command)
app.command("reproduce")(reproduce_command)
app.command("study")(study_command)
app.command("lm-eval", **LM_EVAL_SETTINGS)(lm_eval_command)
app.command("methods")(methods_command)
app.command("tasks")(tasks_command)


def _show_notice(shown):
    """`warnings.showwarning` printing a `Notice` as one `note:` line (its settings as flags), others as `shown`."""

    def show(message, category, filename, lineno, file=None, line=None):
        if isinstance(message, Notice):
            print("note: " + " ".join(message.phrased(flag).split()), file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    return show


def main() -> None:
    """Entry point: user errors and usage errors become one clear line and exit code 2."""
    with warnings.catch_warnings():  # the notices' printer leaves with the command (tests run it in-process)
        warnings.showwarning = _show_notice(warnings.showwarning)
        _main()


def _main() -> None:
    try:
        from typer._click.exceptions import ClickException, NoArgsIsHelpError
    except ImportError:  # older typer uses click itself
        from click.exceptions import ClickException, NoArgsIsHelpError
    try:
        code = app(standalone_mode=False)
    except UserError as err:
        print("error: " + " ".join(err.phrased(flag).split()), file=sys.stderr)  # always exactly one line
        sys.exit(2)
    except OSError as err:  # a file we were given or told to write, failing where no check caught it
        if err.filename is None:
            raise
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        sys.exit(2)
    except NoArgsIsHelpError as err:
        print(err.ctx.get_help() if err.ctx else str(err))
        sys.exit(0)
    except ClickException as err:  # a usage mistake: an unknown option, a value not among an option's choices
        message = " ".join(err.format_message().replace("Value error, ", "").split())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(err.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    if code == 130:  # typer turns Ctrl-C inside a command into exit code 130
        print("error: interrupted; finished work is kept: rerun the same command to resume", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
