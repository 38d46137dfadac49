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


@app.command("score")
def score(
    pred_file: str = typer.Argument(
        ..., help="JSON lines {dataset, pred, answers, all_classes[, length]} (length needed for *_e)."
    ),
    out: str = typer.Option(..., "--out", help="Per-dataset CSV: dataset,n,score (+ rows <dataset>@0-4k/@4-8k/@8k+ for *_e)."),
    samples: str | None = typer.Option(None, "--samples", help="Per-sample CSV: line (0-based),dataset,score."),
) -> None:
    """Score a predictions file with the official LongBench metrics (also rescores other tools' outputs)."""
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from ripplekv.metrics import load_predictions, score_predictions

    datasets, per_sample = score_predictions(load_predictions(Path(pred_file)))
    for target, frame in ((out, datasets), (samples, per_sample)):
        if target is not None:
            try:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                frame.to_csv(target, index=False)
            except OSError as err:
                raise UserError(f"cannot write {target}: {err.strerror or err}") from None

    table = Table(title=f"LongBench scores: {pred_file}")
    table.add_column("dataset")
    table.add_column("n", justify="right")
    table.add_column("score", justify="right")
    for row in datasets.itertuples(index=False):
        table.add_row(row.dataset, str(row.n), f"{row.score:.2f}")
    Console().print(table)


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
