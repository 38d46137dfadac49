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


@app.callback()
def _root() -> None:
    """Benchmark KV-cache compression methods under exactly matched budgets."""


# --- commands: budgets (engine) ---


def split_list(text: str) -> list[str]:
    """`a,b, c` -> ['a', 'b', 'c'] (empty items dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def model_shape(model: str | None) -> tuple[int, int]:
    """(layers, KV heads) of a model from its config alone, without loading weights."""
    from ripplekv.models import load_config

    config = load_config(model)
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads)


@app.command()
def budgets(
    methods: str = typer.Option("snapkv,streamingllm,pyramidkv", help="Comma-separated methods."),
    budget: int = typer.Option(128, help="Average prompt entries kept per layer per KV head."),
    prompt_len: int = typer.Option(3500, "--prompt-len", help="Prompt length n in tokens."),
    allocation: str | None = typer.Option(None, help="Allocation CSV (layer,multiplier) for ripplekv."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    output_format: str = typer.Option("table", "--format", help="table or csv."),
) -> None:
    """Print each method's per-layer budgets, so you can see how it spends the cache."""
    from ripplekv.budgets import check_budget
    from ripplekv.methods import make_method

    check_budget(budget)
    if prompt_len <= 0:
        raise UserError(f"--prompt-len must be a positive number of tokens, got {prompt_len}")
    if output_format not in ("table", "csv"):
        raise UserError(f"--format must be table or csv, got {output_format!r}")
    chosen = [make_method(name, allocation=allocation) for name in split_list(methods)]
    num_layers, kv_heads = model_shape(model)
    rows = {m.name: m.layer_budgets(num_layers, budget, prompt_len) for m in chosen}
    if output_format == "csv":
        print("method,layer,budget")
        for name, counts in rows.items():
            for layer, count in enumerate(counts):
                print(f"{name},{layer},{count}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"per-layer budgets at B={budget}, n={prompt_len} ({num_layers} layers x {kv_heads} KV heads)")
    table.add_column("layer", justify="right")
    for name in rows:
        table.add_column(name, justify="right")
    for layer in range(num_layers):
        table.add_row(str(layer), *(str(rows[name][layer]) for name in rows))
    table.add_row("total", *(str(sum(rows[name])) for name in rows), style="bold")
    Console().print(table)


# --- commands: profile, allocate ---

# --- commands: eval, report ---


@app.command("eval")
def eval_command(
    budget: list[str] = typer.Option(
        ..., "--budget", help="Average prompt entries kept per layer per KV head; repeat or comma-separate (128,256)."
    ),
    out: str = typer.Option(..., "--out", help="Run directory; rerunning the same command resumes it."),
    methods: str = typer.Option(",".join(("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")),
                                "--methods", help="Comma-separated methods (full is always included)."),
    suite: str = typer.Option("offline", "--suite", help="offline (bundled), longbench or longbench-e."),
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated tasks of the suite (default: all)."),
    limit: int | None = typer.Option(None, "--limit", help="At most N samples per task."),
    allocation: str | None = typer.Option(None, "--allocation", help="Allocation CSV from `ripplekv allocate` (for ripplekv)."),
    model: str | None = typer.Option(None, "--model", help="Hub id, model directory or .gguf; default: bundled SmolLM2-135M."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Folder (or data.zip) of the official LongBench files."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Offline suite: prompt length to build, in tokens."),
    max_length: int = typer.Option(7500, "--max-length", help="Prompts longer than this are truncated in the middle."),
    batch_size: int = typer.Option(16, "--batch-size", help="Compressed variants decoded together."),
) -> None:
    """Score every method at every budget: one prefill per sample, all variants decoded from it."""
    from rich.console import Console

    from ripplekv import evaluate, report

    settings = evaluate.EvalSettings(
        budgets=evaluate.parse_budgets(budget),
        methods=evaluate.parse_names(methods),
        suite=suite,
        tasks=evaluate.parse_names(tasks),
        limit=limit,
        allocation=allocation,
        model=model,
        data_dir=data_dir,
        target_tokens=target_tokens,
        max_length=max_length,
        batch_size=batch_size,
    )
    run_dir = evaluate.run_eval(settings, out)
    board = report.leaderboard(report.task_scores(report.load_predictions(run_dir)))
    Console().print(report.summary_table(board, title=f"average score (kl) by method and budget: {run_dir}"))


@app.command("report")
def report_command(
    run_dir: str = typer.Argument(..., help="A directory written by `ripplekv eval`."),
) -> None:
    """Re-render scores.csv, leaderboards, plots and summary.md from predictions.jsonl alone."""
    from rich.console import Console

    from ripplekv import report

    tables = report.render(run_dir)
    Console().print(report.summary_table(tables["leaderboard"], title=f"average score (kl): {run_dir}"))

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
    """Entry point: user errors and usage errors become one clear line and exit code 2."""
    try:
        from typer._click.exceptions import ClickException, NoArgsIsHelpError
    except ImportError:  # older typer uses click itself
        from click.exceptions import ClickException, NoArgsIsHelpError
    try:
        code = app(standalone_mode=False)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except NoArgsIsHelpError as err:
        print(err.ctx.get_help() if err.ctx else str(err))
        sys.exit(0)
    except ClickException as err:
        print(f"error: {err.format_message()}", file=sys.stderr)
        sys.exit(err.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("error: interrupted; results written so far are kept", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
