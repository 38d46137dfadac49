"""The `ripplekv` command line: one Typer app, one command per pipeline stage.

User mistakes raise `UserError`; `main` turns them into one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

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


WINDOW_HELP = "SnapKV observation window (always kept); default 32."
KERNEL_HELP = "SnapKV pooling kernel; default 7."
POOLING_HELP = "SnapKV pooling: max (default), avg or none."


def snap_options(window: int | None, kernel: int | None, pooling: str | None) -> dict:
    """SnapKV scoring options the user set (the rest keep the methods' documented defaults)."""
    given = {"window": window, "kernel": kernel, "pooling": pooling}
    return {key: value for key, value in given.items() if value is not None}


def split_list(text: str, option: str) -> list[str]:
    """`a,b, c` -> ['a', 'b', 'c'] (empty items dropped); an empty list is a UserError naming `option`."""
    from ripplekv.evaluate import parse_names

    return list(parse_names(text, option))


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
    window: int | None = typer.Option(None, help=WINDOW_HELP),
    kernel: int | None = typer.Option(None, help=KERNEL_HELP),
    pooling: str | None = typer.Option(None, help=POOLING_HELP),
) -> None:
    """Print each method's per-layer budgets, so you can see how it spends the cache."""
    from ripplekv.budgets import check_budget
    from ripplekv.methods import make_method

    check_budget(budget)
    if prompt_len <= 0:
        raise UserError(f"--prompt-len must be a positive number of tokens, got {prompt_len}")
    if output_format not in ("table", "csv"):
        raise UserError(f"--format must be table or csv, got {output_format!r}")
    options = snap_options(window, kernel, pooling)
    chosen = [make_method(name, allocation=allocation, **options) for name in split_list(methods, "--methods")]
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


def _progress_bar(description: str, total: int, completed: int = 0):
    """A rich progress bar with ETA; returns (progress, advance callback)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    task = progress.add_task(description, total=total, completed=completed)
    return progress, lambda _index: progress.advance(task)


@app.command()
def profile(
    out: str = typer.Option(..., help="Directory for sensitivity.csv, per_sample.csv, profile.json, sensitivity.png."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    calib_samples: int = typer.Option(12, "--calib-samples", help="Calibration prompts (offline suite's calibration split)."),
    seeds: int = typer.Option(2, help="Noise draws per sample."),
    eta: float = typer.Option(0.3, help="Noise scale relative to each value vector RMS (KL grows as eta^2 up to ~1)."),
    signal: str = typer.Option("noise", help="noise (RippleKV) or evict (DepthKV-style: SnapKV-evict one layer)."),
    evict_budget: int = typer.Option(128, "--evict-budget", help="Budget a layer is evicted to with --signal evict."),
    probe_tokens: int = typer.Option(16, "--probe-tokens", help="Final prompt tokens used as probes (the question)."),
    with_answer: bool = typer.Option(False, "--with-answer", help="Also teacher-force the reference answer as probes."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    batch_size: int = typer.Option(32, "--batch-size", help="Perturbed layers run together in one batch."),
) -> None:
    """Measure each layer's sensitivity: perturb its value cache, KL at the output.

    Rerunning the same command resumes an interrupted profile (finished samples are kept)."""
    from rich.console import Console

    from ripplekv.budgets import check_budget
    from ripplekv.profile import ProfileSettings, profile_into

    settings = ProfileSettings(eta, seeds, signal, probe_tokens, check_budget(evict_budget), batch_size)
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    count, meta = profile_into(Path(out), model, settings, calib_samples=calib_samples, target_tokens=target_tokens,
                               with_answer=with_answer, bar=lambda total, done: _progress_bar("profiling", total, done))
    rho = meta["split_half_spearman"]
    Console(stderr=True).print(
        f"profiled {count} samples x {meta['num_layers']} layers; split-half Spearman rho = "
        + (f"{rho:.3f}" if rho is not None else "n/a (one sample)")
        + f"; wrote {out}/sensitivity.csv"
    )


@app.command()
def allocate(
    sensitivity: str = typer.Argument(..., help="sensitivity.csv from `ripplekv profile`."),
    out: str = typer.Option(..., help="Allocation CSV to write (layer,sensitivity,multiplier)."),
    ratio: list[float] = typer.Option([4.0], help="Max/min budget multiplier; repeat to let calibration choose."),
    model: str | None = typer.Option(None, help="Model the profile belongs to; default: bundled SmolLM2."),
    budget: int = typer.Option(128, help="Budget at which calibration compares ratios."),
    calib_samples: int = typer.Option(7, "--calib-samples", help="Calibration prompts for choosing among ratios."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
) -> None:
    """Turn a sensitivity profile into per-layer budget multipliers (and pick the ratio by calibration)."""
    from rich.console import Console

    from ripplekv.allocate import run_allocate
    from ripplekv.budgets import check_budget

    check_budget(budget)
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    run_allocate(sensitivity, Path(out), ratio, model, budget, calib_samples, target_tokens, Console(stderr=True),
                 bar=lambda total, done: _progress_bar("choosing ratio", total, done))


# --- commands: eval, report ---


@app.command("eval")
def eval_command(
    budget: list[str] = typer.Option(
        ..., "--budget", help="Average prompt entries kept per layer per KV head; repeat or comma-separate (128,256)."
    ),
    out: str = typer.Option(..., "--out", help="Run directory; rerunning the same command resumes it."),
    methods: str = typer.Option(",".join(("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")),
                                "--methods", help="Comma-separated methods (full is always included)."),
    suite: str | None = typer.Option(
        None, "--suite", help="offline (bundled), longbench or longbench-e; default: longbench when its files are on disk, else offline."
    ),
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated tasks of the suite (default: all)."),
    limit: int | None = typer.Option(None, "--limit", help="At most N samples per task."),
    allocation: str | None = typer.Option(None, "--allocation", help="Allocation CSV from `ripplekv allocate` (for ripplekv)."),
    model: str | None = typer.Option(None, "--model", help="Hub id, model directory or .gguf; default: bundled SmolLM2-135M."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Folder (or data.zip) of the official LongBench files."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Offline suite: prompt length to build, in tokens."),
    max_length: int = typer.Option(7500, "--max-length", help="Prompts longer than this are truncated in the middle."),
    batch_size: int = typer.Option(16, "--batch-size", help="Compressed variants decoded together."),
    window: int | None = typer.Option(None, help=WINDOW_HELP),
    kernel: int | None = typer.Option(None, help=KERNEL_HELP),
    pooling: str | None = typer.Option(None, help=POOLING_HELP),
) -> None:
    """Score every method at every budget: one prefill per sample, all variants decoded from it."""
    from rich.console import Console

    from ripplekv import evaluate, report
    from ripplekv.data.tasks import default_suite

    settings = evaluate.EvalSettings(
        budgets=evaluate.parse_budgets(budget),
        methods=evaluate.parse_names(methods, "--methods"),
        suite=suite or default_suite(data_dir),
        tasks=evaluate.parse_names(tasks, "--tasks"),
        limit=limit,
        allocation=allocation,
        model=model,
        data_dir=data_dir,
        target_tokens=target_tokens,
        max_length=max_length,
        batch_size=batch_size,
        method_options=snap_options(window, kernel, pooling),
        capture_window=max(64, window or 0),
    )
    tables = evaluate.run_eval(settings, out)
    Console().print(report.summary_table(tables["leaderboard"], title=f"average score (kl): {out}"))


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
    from ripplekv.safeio import check_output, write_csv

    check_output(out, inputs=[pred_file])
    if samples is not None:
        check_output(samples, inputs=[pred_file, out], option="--samples")
    datasets, per_sample = score_predictions(load_predictions(Path(pred_file)))
    write_csv(out, datasets)
    if samples is not None:
        write_csv(samples, per_sample)

    table = Table(title=f"LongBench scores: {pred_file}")
    table.add_column("dataset")
    table.add_column("n", justify="right")
    table.add_column("score", justify="right")
    for row in datasets.itertuples(index=False):
        table.add_row(row.dataset, str(row.n), f"{row.score:.2f}")
    Console().print(table)


# --- commands: tasks ---


@app.command("tasks")
def tasks_command(
    suite: str | None = typer.Option(None, "--suite", help="Only this suite: offline, longbench or longbench-e."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Folder (or data.zip) of the official LongBench files."),
) -> None:
    """List the suites and their tasks: category, metric, generation length and size."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ripplekv.data.tasks import task_rows

    rows = task_rows(suite, data_dir)
    table = Table(title="ripplekv tasks", box=box.SIMPLE_HEAD)
    for column in ("suite", "task", "category", "metric", "max new", "size"):
        table.add_column(column, justify="right" if column == "max new" else "left", no_wrap=True)
    for row in rows:
        table.add_row(row["suite"], row["task"], row["category"], row["metric"],
                      str(row["max_new_tokens"]), row["size"])
    console = Console()
    if not console.is_terminal:  # piped: don't squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)


def main() -> None:
    """Entry point: user errors and usage errors become one clear line and exit code 2."""
    try:
        from typer._click.exceptions import ClickException, NoArgsIsHelpError
    except ImportError:  # older typer uses click itself
        from click.exceptions import ClickException, NoArgsIsHelpError
    try:
        code = app(standalone_mode=False)
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)  # always exactly one line
        sys.exit(2)
    except OSError as err:  # a file we were given or told to write, failing where no check caught it
        if err.filename is None:
            raise
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        sys.exit(2)
    except NoArgsIsHelpError as err:
        print(err.ctx.get_help() if err.ctx else str(err))
        sys.exit(0)
    except ClickException as err:
        print(f"error: {err.format_message()}", file=sys.stderr)
        sys.exit(err.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    if code == 130:  # typer turns Ctrl-C inside a command into exit code 130
        print("error: interrupted; finished work is kept: rerun the same command to resume", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
