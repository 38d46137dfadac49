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
METHODS_HELP = "Comma-separated method specs, e.g. snapkv,pyramidkv:beta=10,ripplekv:scorer=random (`ripplekv methods`)."
ROUTE_HELP = "Route CSV (layer,method) for the routed method."
DEVICE_HELP = "auto (CUDA when a GPU is there, else CPU), cpu, cuda or cuda:N."
DTYPE_HELP = "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."


def snap_options(window: int | None, kernel: int | None, pooling: str | None) -> dict:
    """SnapKV scoring options the user set (the rest keep the methods' documented defaults)."""
    given = {"window": window, "kernel": kernel, "pooling": pooling}
    return {key: value for key, value in given.items() if value is not None}


def model_shape(model: str | None) -> tuple[int, int]:
    """(layers, KV heads) of a model from its config alone, without loading weights."""
    from ripplekv.models import load_config

    config = load_config(model)
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads)


@app.command()
def budgets(
    methods: str = typer.Option("snapkv,streamingllm,pyramidkv", help=METHODS_HELP),
    budget: int = typer.Option(128, help="Average prompt entries kept per layer per KV head."),
    prompt_len: int = typer.Option(3500, "--prompt-len", help="Prompt length n in tokens."),
    allocation: str | None = typer.Option(None, help="Allocation CSV (layer,multiplier) for ripplekv."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    output_format: str = typer.Option("table", "--format", help="table or csv."),
    window: int | None = typer.Option(None, help=WINDOW_HELP),
    kernel: int | None = typer.Option(None, help=KERNEL_HELP),
    pooling: str | None = typer.Option(None, help=POOLING_HELP),
    route: str | None = typer.Option(None, help=ROUTE_HELP),
) -> None:
    """Print each method's per-layer budgets, so you can see how it spends the cache."""
    from ripplekv.budgets import check_budget
    from ripplekv.evaluate import parse_names
    from ripplekv.methods import make_method

    check_budget(budget)
    if prompt_len <= 0:
        raise UserError(f"--prompt-len must be a positive number of tokens, got {prompt_len}")
    if output_format not in ("table", "csv"):
        raise UserError(f"--format must be table or csv, got {output_format!r}")
    shared = {**snap_options(window, kernel, pooling), "allocation": allocation, "route": route}
    specs = parse_names(methods)
    if not specs:
        raise UserError("--methods is empty; name at least one method, e.g. --methods snapkv,pyramidkv")
    chosen = [make_method(spec, shared=shared) for spec in specs]
    for method in chosen:
        if method.allocator.needs_prompt:
            raise UserError(f"{method.label} splits budgets by the prompt's scores; {method.allocator.prompt_note}")
    num_layers, kv_heads = model_shape(model)
    rows = {m.label: m.layer_budgets(num_layers, budget, prompt_len) for m in chosen}
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


def _progress_bar(description: str, total: int):
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
    task = progress.add_task(description, total=total)
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
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Measure each layer's sensitivity: perturb its value cache, KL at the output."""
    from rich.console import Console

    from ripplekv.budgets import check_budget
    from ripplekv.models import load_model, resolve_device_dtype, runtime_info
    from ripplekv.profile import ProfileSettings, calibration_prompts, run_profile, write_profile

    settings = ProfileSettings(eta, seeds, signal, probe_tokens, check_budget(evict_budget), batch_size)
    settings.check()
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    console = Console(stderr=True)
    device, dtype = resolve_device_dtype(device, dtype)
    loaded, tokenizer, source = load_model(model, device=device, dtype=dtype)
    prompts = calibration_prompts(tokenizer, calib_samples, probe_tokens, target_tokens, with_answer=with_answer)
    progress, advance = _progress_bar("profiling", len(prompts))
    with progress:
        result = run_profile(loaded, prompts, settings, source.label, progress=advance)
    result.extra.update({"device": device, "dtype": dtype, **runtime_info(device)})
    meta = write_profile(result, prompts, Path(out))
    rho = meta["split_half_spearman"]
    console.print(
        f"profiled {len(prompts)} samples x {meta['num_layers']} layers; split-half Spearman rho = "
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
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Turn a sensitivity profile into per-layer budget multipliers (and pick the ratio by calibration)."""
    import json

    from rich.console import Console

    from ripplekv.allocate import check_ratio, multipliers, plot_allocation, ratio_sweep, read_sensitivity, write_allocation
    from ripplekv.budgets import check_budget

    ratios = sorted({check_ratio(r) for r in ratio})
    check_budget(budget)
    console = Console(stderr=True)
    num_layers, _ = model_shape(model)
    values = read_sensitivity(sensitivity, num_layers)
    out_path = Path(out)
    chosen = ratios[0]
    if len(ratios) > 1:
        from ripplekv.models import load_model
        from ripplekv.profile import calibration_prompts

        loaded, tokenizer, _ = load_model(model, device=device, dtype=dtype)
        prompts = calibration_prompts(tokenizer, calib_samples, 1, target_tokens)
        progress, advance = _progress_bar("choosing ratio", len(prompts))
        with progress:
            sweep = ratio_sweep(loaded, prompts, values, ratios, budget, progress=advance)
        chosen = float(sweep.sort_values(["kl", "ratio"]).iloc[0]["ratio"])
        sweep = sweep.assign(chosen=sweep["ratio"] == chosen)
        sweep_path = out_path.with_name(out_path.stem + ".sweep.csv")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        sweep.to_csv(sweep_path, index=False)
        (out_path.with_name(out_path.stem + ".choice.json")).write_text(
            json.dumps({"ratio": chosen, "candidates": ratios, "budget": budget, "calibration_ids": [p.sample_id for p in prompts]}, indent=2)
            + "\n"
        )
        console.print(sweep.to_string(index=False))
        console.print(f"chose ratio {chosen:g} (lowest teacher-forced KL at B={budget}); sweep in {sweep_path}")
    mult = multipliers(values, chosen)
    write_allocation(out_path, values, mult)
    plot_allocation(out_path.with_suffix(".png"), values, mult, chosen, num_layers)
    console.print(f"wrote {out_path} (ratio {chosen:g}; multipliers {mult.min():.3f}..{mult.max():.3f}) and {out_path.with_suffix('.png')}")


# --- commands: eval, report ---


@app.command("eval")
def eval_command(
    budget: list[str] = typer.Option(
        ..., "--budget", help="Average prompt entries kept per layer per KV head; repeat or comma-separate (128,256)."
    ),
    out: str = typer.Option(..., "--out", help="Run directory; rerunning the same command resumes it."),
    methods: str = typer.Option(",".join(("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")),
                                "--methods", help=METHODS_HELP + " full is always included."),
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
    route: str | None = typer.Option(None, "--route", help=ROUTE_HELP),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Score every method at every budget: one prefill per sample, all variants decoded from it."""
    from rich.console import Console

    from ripplekv import evaluate, report
    from ripplekv.data.tasks import default_suite

    settings = evaluate.EvalSettings(
        budgets=evaluate.parse_budgets(budget),
        methods=evaluate.parse_names(methods),
        suite=suite or default_suite(data_dir),
        tasks=evaluate.parse_names(tasks),
        limit=limit,
        allocation=allocation,
        model=model,
        data_dir=data_dir,
        target_tokens=target_tokens,
        max_length=max_length,
        batch_size=batch_size,
        method_options=snap_options(window, kernel, pooling),
        capture_window=max(64, window or 0),
        route=route,
        device=device,
        dtype=dtype,
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


# --- commands: methods ---


@app.command("methods")
def methods_command() -> None:
    """List every method: its allocator, its scorer and their options with defaults."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ripplekv.methods import ALLOCATORS, PRESETS, SCORERS
    from ripplekv.methods.presets import defaults_of

    def options(component) -> str:
        return ", ".join(f"{k}={v}" for k, v in defaults_of(component).items()) or "-"

    table = Table(title="ripplekv methods (spec: name[:option=value...])", box=box.SIMPLE_HEAD)
    for column in ("method", "allocator", "scorer", "options (defaults)", "what it is"):
        table.add_column(column, overflow="fold")
    for name, chosen in sorted(PRESETS.items()):
        if chosen.scorer is None:
            table.add_row(name, "-", "-", "-", chosen.about)
            continue
        opts = "; ".join(o for o in (options(ALLOCATORS[chosen.allocator]), options(SCORERS[chosen.scorer])) if o != "-")
        table.add_row(name, chosen.allocator, chosen.scorer, opts or "-", chosen.about)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)
    console.print(f"allocators: {', '.join(sorted(ALLOCATORS))}; scorers: {', '.join(sorted(SCORERS))} "
                  "(swap one with allocator=NAME or scorer=NAME)")


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


if __name__ == "__main__":
    main()
