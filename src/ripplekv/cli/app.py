"""The `ripplekv` command line: one Typer app, one command per pipeline stage.

User mistakes raise `UserError`; `main` turns them into one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ripplekv.defaults import DEFAULT_EVAL_METHODS
from ripplekv.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help: flags without a `<bool>` type, and defaults wrapped instead of cut off at the edge.
    rich_markup_mode=None,
    help="Benchmark KV-cache compression methods under exactly matched budgets.",
)

# Where each stage writes when no --out is given, and where the next stage looks for it.
DEFAULT_PROFILE = Path("runs/profile")
DEFAULT_ALLOCATION = Path("runs/allocate/allocation.csv")
DEFAULT_EVAL = Path("runs/eval")
# Samples per task `eval` takes from the offline suite without --limit: the defaults finish in minutes.
OFFLINE_FIRST_LOOK = 3


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


def _say_out(console, command: str, out, given: bool) -> None:
    """First line of a command: where its outputs go (and that it is the default, when it is)."""
    console.print(f"{command}: writing to {out}" + ("" if given else " (the default; choose with --out)"), soft_wrap=True)


def _say_written(console, paths) -> None:
    """Last lines of a command: every file it wrote."""
    console.print("wrote: " + ", ".join(str(p) for p in paths), soft_wrap=True)


# --- commands: budgets (engine) ---


WINDOW_HELP = "SnapKV observation window (always kept); default 32."
KERNEL_HELP = "SnapKV pooling kernel; default 7."
POOLING_HELP = "SnapKV pooling: max (default), avg or none."
METHODS_HELP = "Comma-separated method specs, e.g. snapkv,pyramidkv:beta=10,ripplekv:scorer=random (`ripplekv methods`)."
ROUTE_HELP = "Route CSV (layer,method) for the routed method."
DEVICE_HELP = "auto (CUDA when a GPU is there, else CPU), cpu, cuda or cuda:N."
DTYPE_HELP = "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."
WORKERS_HELP = "Ray workers, each loading the model once (one GPU each on CUDA, else a share of the cores)."
RAY_ADDRESS_HELP = "Join a running Ray cluster (`ray start --head`) instead of starting a local one."


def worker_settings(workers: int, ray_address: str | None):
    """--workers / --ray-address, checked (Ray itself is imported only when they ask for it)."""
    from ripplekv.pipeline.distributed import Workers, check_reachable, import_ray

    chosen = Workers(count=workers, address=ray_address or None)
    chosen.check()
    if chosen.uses_ray:  # a missing Ray or an unreachable cluster is said before any work starts
        import_ray(local=chosen.address is None)
        if chosen.address is not None:
            check_reachable(chosen.address)
    return chosen


def snap_options(window: int | None, kernel: int | None, pooling: str | None) -> dict:
    """SnapKV scoring options the user set (the rest keep the methods' documented defaults)."""
    given = {"window": window, "kernel": kernel, "pooling": pooling}
    return {key: value for key, value in given.items() if value is not None}


def model_shape(model: str | None) -> tuple[int, int]:
    """(layers, KV heads) of a model from its config alone, without loading weights."""
    from ripplekv.engine.models import load_config

    config = load_config(model)
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads)


@app.command()
def budgets(
    methods: str = typer.Option("snapkv,streamingllm,pyramidkv", help=METHODS_HELP),
    budget: int = typer.Option(128, help="Average prompt entries kept per layer per KV head."),
    prompt_len: int = typer.Option(3500, "--prompt-len", help="Prompt length n in tokens."),
    allocation: str | None = typer.Option(None, help="Allocation CSV (layer,multiplier) for ripplekv or depthkv."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    output_format: str = typer.Option("table", "--format", help="table or csv."),
    window: int | None = typer.Option(None, help=WINDOW_HELP),
    kernel: int | None = typer.Option(None, help=KERNEL_HELP),
    pooling: str | None = typer.Option(None, help=POOLING_HELP),
    route: str | None = typer.Option(None, help=ROUTE_HELP),
) -> None:
    """Print each method's per-layer budgets, so you can see how it spends the cache."""
    from ripplekv.methods import make_method
    from ripplekv.methods.budgets import check_budget
    from ripplekv.methods.presets import check_distinct, degenerate_notes
    from ripplekv.pipeline.evaluate import parse_names

    check_budget(budget)
    if prompt_len <= 0:
        raise UserError(f"--prompt-len must be a positive number of tokens, got {prompt_len}")
    if output_format not in ("table", "csv"):
        raise UserError(f"--format must be table or csv, got {output_format!r}")
    shared = {**snap_options(window, kernel, pooling), "allocation": allocation, "route": route}
    specs = parse_names(methods, "--methods")
    chosen = [make_method(spec, shared=shared) for spec in specs]
    check_distinct(chosen)
    num_layers, kv_heads = model_shape(model)
    # A prompt-dependent allocator shows what is known without a prompt (AdaKV: its per-layer totals) or
    # says why it cannot (CAKE: layers depend on the prompt's attention).
    rows = {m.label: m.layer_budgets(num_layers, budget, prompt_len) for m in chosen}
    for note in degenerate_notes(chosen, [budget]):
        print(note, file=sys.stderr)
    for method in chosen:
        if method.prompt_dependent:
            print(f"note: {method.label} splits each layer's budget across its KV heads by the prompt's scores; "
                  "per-head counts are recorded per sample by `ripplekv eval`", file=sys.stderr)
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
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from ripplekv.pipeline.progress import Throughput

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        Throughput(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    task = progress.add_task(description, total=total, completed=completed)
    return progress, lambda _index: progress.advance(task)


@app.command()
def profile(
    out: str | None = typer.Option(None, help=f"Directory for sensitivity.csv, per_sample.csv, profile.json, "
                                   f"sensitivity.png; default: {DEFAULT_PROFILE}."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    calib_samples: int = typer.Option(
        4, "--calib-samples", help="Calibration prompts (offline suite's calibration split); make reproduce uses 12."),
    seeds: int = typer.Option(1, help="Noise draws per sample; make reproduce uses 2."),
    eta: float = typer.Option(0.3, help="Noise scale relative to each value vector RMS (KL grows as eta^2 up to ~1)."),
    signal: str = typer.Option("noise", help="noise (RippleKV) or evict (DepthKV: evict one layer with --evict-method)."),
    evict_budget: int = typer.Option(128, "--evict-budget", help="Budget a layer is evicted to with --signal evict (the global ratio: the evaluation budget)."),
    evict_method: str = typer.Option("h2o", "--evict-method", help="Method whose selection evicts the layer with --signal evict (DepthKV: h2o)."),
    probe_tokens: int = typer.Option(16, "--probe-tokens", help="Final prompt tokens used as probes (the question)."),
    with_answer: bool = typer.Option(False, "--with-answer", help="Also teacher-force the reference answer as probes."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    batch_size: int = typer.Option(32, "--batch-size", help="Perturbed layers run together in one batch."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    workers: int = typer.Option(1, "--workers", help=WORKERS_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Measure each layer's sensitivity: perturb its value cache, KL at the output.

    Rerunning the same command resumes an interrupted profile (finished samples are kept)."""
    from rich.console import Console

    from ripplekv.engine.models import resolve_device_dtype
    from ripplekv.methods.budgets import check_budget
    from ripplekv.pipeline.profile import ProfileSettings, profile_into

    settings = ProfileSettings(eta, seeds, signal, probe_tokens, check_budget(evict_budget), batch_size, evict_method)
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    scale = worker_settings(workers, ray_address)
    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_PROFILE
    device, dtype = resolve_device_dtype(device, dtype)
    count, meta = profile_into(out_dir, model, settings, calib_samples=calib_samples, target_tokens=target_tokens,
                               with_answer=with_answer, device=device, dtype=dtype, workers=scale,
                               bar=lambda total, done: _progress_bar("profiling", total, done),
                               announce=lambda: _say_out(console, "profile", out_dir, out is not None))
    rho = meta["split_half_spearman"]
    console.print(
        f"profiled {count} samples x {meta['num_layers']} layers; split-half Spearman rho = "
        + (f"{rho:.3f}" if rho is not None else "n/a (one sample)")
    )
    _say_written(console, [out_dir / name for name in ("sensitivity.csv", "per_sample.csv", "profile.json", "sensitivity.png")])


@app.command()
def allocate(
    sensitivity: str | None = typer.Argument(
        None, help=f"sensitivity.csv from `ripplekv profile`; default: {DEFAULT_PROFILE}/sensitivity.csv."),
    out: str | None = typer.Option(
        None, help=f"Allocation CSV to write (layer,sensitivity,multiplier); default: {DEFAULT_ALLOCATION}."),
    ratio: list[float] | None = typer.Option(
        None, help="Max/min budget multiplier (exponential map; default 4); repeat to let calibration choose."
    ),
    mapping: str = typer.Option(
        "exponential", "--map", help="exponential (RippleKV: ratio-bounded) or proportional (DepthKV: budgets proportional to sensitivity)."
    ),
    model: str | None = typer.Option(None, help="Model the profile belongs to; default: bundled SmolLM2."),
    budget: int = typer.Option(128, help="Budget at which calibration compares ratios."),
    calib_samples: int = typer.Option(7, "--calib-samples", help="Calibration prompts for choosing among ratios."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Turn a sensitivity profile into per-layer budget multipliers (and pick the ratio by calibration)."""
    from rich.console import Console

    from ripplekv.methods.budgets import check_budget
    from ripplekv.pipeline.allocate import check_map, run_allocate

    check_map(mapping)
    if mapping == "proportional" and ratio:
        raise UserError("--ratio applies to --map exponential only; --map proportional takes no ratio")
    check_budget(budget)
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    console = Console(stderr=True)
    out_path = Path(out) if out else DEFAULT_ALLOCATION
    if sensitivity is None:
        sensitivity = str(DEFAULT_PROFILE / "sensitivity.csv")
        if not Path(sensitivity).is_file():
            raise UserError(f"no profile at {sensitivity}: run `ripplekv profile` first, or pass a sensitivity.csv")

    def announce() -> None:
        _say_out(console, "allocate", out_path, out is not None)
        console.print(f"allocate: read {sensitivity}", soft_wrap=True)

    written = run_allocate(sensitivity, out_path, ratio or [4.0], model, budget, calib_samples, target_tokens, console,
                           bar=lambda total, done: _progress_bar("choosing ratio", total, done), device=device, dtype=dtype,
                           mapping=mapping, announce=announce)
    _say_written(console, written)


@app.command("route")
def route_command(
    out: str = typer.Option(..., help="Directory for ROUTE.csv, preferences.csv, placements.csv, route.json and plots."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    methods: str = typer.Option("snapkv,streamingllm,h2o,tova,knorm", "--methods",
                                help="Candidate methods (only their scorers are used), comma-separated specs."),
    budget: int = typer.Option(128, help="Budget B a layer is compressed to (entries per KV head)."),
    calib_samples: int = typer.Option(8, "--calib-samples", help="Calibration prompts for the preferences."),
    placements: int = typer.Option(100, help="Random placements (same method counts) to rank the route among; 0 skips."),
    placement_samples: int = typer.Option(4, "--placement-samples",
                                          help="Further calibration prompts (held out from the preferences) that score placements."),
    max_share: list[str] = typer.Option([], "--max-share", help="Cap a method's share of layers: snapkv=0.5 (or 0.5 for all); repeatable."),
    probe_tokens: int = typer.Option(16, "--probe-tokens", help="Final prompt tokens used as probes (as in profile)."),
    with_answer: bool = typer.Option(False, "--with-answer", help="Also teacher-force the reference answer as probes."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Length of the full cache's answer placements are scored on."),
    batch_size: int = typer.Option(32, "--batch-size", help="(layer, method) trials or placements run together."),
    seed: int = typer.Option(0, help="Seed of the random placements."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Route a method to each layer by per-(layer, method) KL, and rank the route among random placements."""
    from rich.console import Console

    from ripplekv.engine.models import resolve_device_dtype
    from ripplekv.pipeline.evaluate import parse_names
    from ripplekv.pipeline.route import RouteSettings, candidate_methods, check_route_dir, parse_caps
    from ripplekv.runs.safeio import exclusive

    listed = [part.strip() for part in methods.split(",") if part.strip()]
    if len(set(listed)) < len(listed):
        raise UserError(f"--methods lists a candidate twice ({methods}); name each candidate once")
    settings = RouteSettings(parse_names(methods), budget, probe_tokens, batch_size, tuple(max_share), placements,
                             max_new_tokens, seed)
    settings.check()
    labels = [m.label for m in candidate_methods(settings.methods)]
    parse_caps(settings.max_share, labels, model_shape(model)[0])  # bad caps fail before the model loads
    if calib_samples < 1 or placement_samples < 0:
        raise UserError("--calib-samples must be at least 1 and --placement-samples at least 0")
    out_dir = check_route_dir(Path(out), model)
    console = Console(stderr=True)
    device, dtype = resolve_device_dtype(device, dtype)
    with exclusive(out_dir, "route"):
        _route_locked(out_dir, model, settings, calib_samples, placement_samples, placements, probe_tokens,
                      target_tokens, with_answer, budget, device, dtype, console)


def _route_locked(out, model, settings, calib_samples, placement_samples, placements, probe_tokens, target_tokens,
                  with_answer, budget, device, dtype, console) -> None:
    from ripplekv.engine.models import load_model, runtime_info
    from ripplekv.pipeline.route import run_route, write_route
    from ripplekv.tasks.calibration import calibration_hash, calibration_prompts

    loaded, tokenizer, source = load_model(model, device=device, dtype=dtype)
    held_out = placement_samples if placements else 0
    prompts = calibration_prompts(tokenizer, calib_samples + held_out, probe_tokens, target_tokens, with_answer=with_answer)
    chosen, scored = prompts[:calib_samples], prompts[calib_samples:]
    if held_out and not scored:
        raise UserError(f"the calibration split has only {len(prompts)} prompts; lower --calib-samples to leave some for placements")
    progress, advance = _progress_bar("routing", len(chosen) + len(scored))
    with progress:
        result = run_route(loaded, chosen, scored, settings, progress=advance)
    meta = {"model": source.label, "calibration_hash": calibration_hash(chosen), "with_answer": with_answer,
            "target_tokens": target_tokens, "device": device, "dtype": dtype, **runtime_info(device)}
    meta = write_route(result, settings, out, meta)
    counts = ", ".join(f"{label} x{count}" for label, count in meta["method_counts"].items())
    rank = meta["placement_rank"]
    console.print(f"route over {len(result.route)} layers: {counts}; wrote {out}/ROUTE.csv")
    if rank is not None:
        console.print(f"placement study: route ranks {rank} of {meta['placements_scored'] + 1} "
                      f"(teacher-forced KL on {len(scored)} held-out calibration prompts, B={budget})")


# --- commands: eval, report ---


@app.command("eval")
def eval_command(
    budget: list[str] = typer.Option(
        ..., "--budget", metavar="B",
        help="Average prompt entries kept per layer per KV head; repeat or comma-separate (128,256).",
    ),
    out: str | None = typer.Option(
        None, "--out", help=f"Run directory (default: {DEFAULT_EVAL}); a rerun resumes it and adds what is new."),
    methods: str = typer.Option(",".join(DEFAULT_EVAL_METHODS),
                                "--methods", help=METHODS_HELP + " full is always included."),
    suite: str | None = typer.Option(
        None, "--suite", help="offline (bundled), longbench or longbench-e; default: longbench when its files are on disk, else offline."
    ),
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated tasks of the suite (default: all)."),
    limit: int | None = typer.Option(
        None, "--limit",
        help=f"At most N samples per task; default: {OFFLINE_FIRST_LOOK} on the offline suite (a first look in "
             "minutes; a rerun with a higher --limit adds samples), all on LongBench."),
    allocation: str | None = typer.Option(
        None, "--allocation",
        help=f"Allocation CSV for ripplekv (and depthkv, routed-ripplekv); default: {DEFAULT_ALLOCATION}, else the one shipped for the bundled model."),
    model: str | None = typer.Option(None, "--model", help="Hub id, model directory or .gguf; default: bundled SmolLM2-135M."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Folder (or data.zip) of the official LongBench files."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Offline suite: prompt length to build, in tokens."),
    max_length: int = typer.Option(7500, "--max-length", help="Prompts longer than this are truncated in the middle."),
    batch_size: int = typer.Option(16, "--batch-size", help="Variants per teacher-forced pass (KL, agreement); decoding after a variant's divergence batches every running variant that fits in memory."),
    window: int | None = typer.Option(None, help=WINDOW_HELP),
    kernel: int | None = typer.Option(None, help=KERNEL_HELP),
    pooling: str | None = typer.Option(None, help=POOLING_HELP),
    route: str | None = typer.Option(None, "--route", help=ROUTE_HELP),
    protocol: str = typer.Option(
        "with-question", "--protocol",
        help="with-question: compress the whole prompt (as the LongBench papers); context-only: compress the "
             "context, then read the question through the compressed cache (a cache reused across questions)."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    workers: int = typer.Option(1, "--workers", help=WORKERS_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Score every method at every budget: one prefill per sample, all variants decoded from it."""
    from rich.console import Console

    from ripplekv.analysis import report
    from ripplekv.pipeline import evaluate
    from ripplekv.tasks.registry import default_suite

    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_EVAL
    names = evaluate.parse_names(methods, "--methods")
    notes = [f"eval: writing to {out_dir}" + ("" if out else " (the default; choose with --out)")]
    from ripplekv.methods.presets import options_taken

    if allocation is None and "allocation" in options_taken(names):
        allocation, note = default_allocation(model)
        notes += [note] if note else []
    suite = suite or default_suite(data_dir)
    settings = evaluate.EvalSettings(
        budgets=evaluate.parse_budgets(budget),
        methods=names,
        suite=suite,
        tasks=evaluate.parse_names(tasks, "--tasks"),
        limit=OFFLINE_FIRST_LOOK if limit is None and suite == "offline" else limit,
        allocation=allocation,
        model=model,
        data_dir=data_dir,
        target_tokens=target_tokens,
        max_length=max_length,
        batch_size=batch_size,
        method_options=snap_options(window, kernel, pooling),
        route=route,
        device=device,
        dtype=dtype,
        protocol=protocol,
    )
    tables = evaluate.run_eval(settings, out_dir, console=console, notes=notes,
                               workers=worker_settings(workers, ray_address))
    Console().print(report.summary_table(tables["leaderboard"], title=f"average score (kl): {out_dir}"))


def default_allocation(model: str | None) -> tuple[str | None, str | None]:
    """(allocation, what to tell the user) when a method with file budgets (ripplekv) runs without --allocation: the last
    `ripplekv allocate`, else the one shipped for the bundled model, else none (ripplekv then says
    how to make one)."""
    from ripplekv.engine.models import DEFAULT_MODEL

    if DEFAULT_ALLOCATION.is_file():
        return str(DEFAULT_ALLOCATION), f"ripplekv: using the last allocation, {DEFAULT_ALLOCATION}"
    if model in (None, "", DEFAULT_MODEL):
        shipped = Path(__file__).parent.parent / "data" / "allocations" / f"{DEFAULT_MODEL}.csv"
        return str(shipped), (f"ripplekv: no {DEFAULT_ALLOCATION} yet; using the allocation shipped for "
                              f"{DEFAULT_MODEL} (made by `make reproduce`)")
    return None, None


ROUGE_HELP = "ROUGE-L for summarization tasks: official (LongBench parity, default) or rouge-score (Google's, as HELM)."


@app.command("report")
def report_command(
    run_dir: str = typer.Argument(..., help="A directory written by `ripplekv eval`."),
    rouge: str = typer.Option("official", "--rouge", help=ROUGE_HELP),
    resamples: int = typer.Option(2000, "--resamples", help="Bootstrap resamples for intervals, p-values and rank probabilities."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap resamples."),
) -> None:
    """Re-render scores.csv, leaderboards (with 95% intervals and tests), plots and summary.md from predictions.jsonl alone."""
    from rich.console import Console

    from ripplekv.analysis import report
    from ripplekv.runs.safeio import exclusive

    report.check_rouge(rouge)
    with exclusive(report.check_run_folder(run_dir), "report"):  # an eval still writing this run would change it under us
        tables = report.render(run_dir, rouge=rouge, resamples=resamples, seed=seed)
    Console().print(report.summary_table(tables["leaderboard"], title=f"average score (kl): {run_dir}"))

# --- commands: score ---


@app.command("score")
def score(
    pred_file: str = typer.Argument(
        ..., help="JSON lines {dataset, pred, answers, all_classes[, length]} (length needed for *_e), "
                  "or the predictions.jsonl of `ripplekv eval` (scored per method and budget)."
    ),
    out: str = typer.Option(..., "--out", help="Per-dataset CSV: dataset,n,score,metric (+ rows <dataset>@0-4k/@4-8k/@8k+ for *_e)."),
    samples: str | None = typer.Option(None, "--samples", help="Per-sample CSV: line (0-based),dataset,score."),
    rouge: str = typer.Option("official", "--rouge", help=ROUGE_HELP),
) -> None:
    """Score a predictions file with the official LongBench metrics (also rescores other tools' outputs)."""
    from pathlib import Path

    import pandas as pd
    from rich.console import Console
    from rich.table import Table

    from ripplekv.metrics.rouge import check_rouge
    from ripplekv.metrics.scoring import load_predictions, score_predictions
    from ripplekv.runs.safeio import check_output, write_csv

    rouge = check_rouge(rouge)
    check_output(out, inputs=[pred_file])
    if samples is not None:
        check_output(samples, inputs=[pred_file, out], option="--samples")
    datasets, per_sample = score_predictions(load_predictions(Path(pred_file)), rouge)
    write_csv(out, datasets)
    if samples is not None:
        write_csv(samples, per_sample)

    table = Table(title=f"LongBench scores: {pred_file}")
    for column in datasets.columns:
        table.add_column(column, justify="left" if column in ("dataset", "method") else "right")
    for row in datasets.to_dict("records"):
        table.add_row(*("" if pd.isna(v) else f"{v:.2f}" if k == "score" else str(v) for k, v in row.items()))
    Console().print(table)


# --- commands: inspect ---


@app.command("inspect")
def inspect_command(
    method: str = typer.Option(..., "--method", help="One method spec, e.g. snapkv or pyramidkv:beta=10."),
    budget: int = typer.Option(..., "--budget", help="Average prompt entries kept per layer per KV head."),
    out: str = typer.Option(..., "--out", help="Directory for kept.npz and kept.png."),
    task: str | None = typer.Option(None, "--task", help="Task of the suite (with --index)."),
    index: int = typer.Option(0, "--index", help="Sample index within the task (0-based)."),
    prompt_file: str | None = typer.Option(None, "--prompt-file", help="A text file used as the whole prompt instead."),
    suite: str = typer.Option("offline", "--suite", help="offline, longbench or longbench-e."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Folder (or data.zip) of the official LongBench files."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Offline suite: prompt length to build, in tokens."),
    max_length: int = typer.Option(7500, "--max-length", help="Prompts longer than this are truncated in the middle."),
    allocation: str | None = typer.Option(None, "--allocation", help="Allocation CSV (ripplekv and other file-budget methods)."),
    route: str | None = typer.Option(None, "--route", help=ROUTE_HELP),
    model: str | None = typer.Option(None, "--model", help="Hub id, model directory or .gguf; default: bundled SmolLM2-135M."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Save and draw which entries a method keeps for one prompt (why did it lose the answer?)."""
    from ripplekv.engine.models import resolve_model
    from ripplekv.methods import make_method
    from ripplekv.methods.budgets import check_budget
    from ripplekv.runs.files import INSPECT_FILES
    from ripplekv.runs.safeio import check_output, exclusive

    check_budget(budget)
    chosen = make_method(method, shared={"allocation": allocation, "route": route})
    if (task is None) == (prompt_file is None):
        raise UserError("give either --task T (with --index I) or --prompt-file FILE")
    if index < 0:
        raise UserError(f"--index must be >= 0, got {index}")
    source = resolve_model(model)
    folder = check_output(out, kind="dir", writes=INSPECT_FILES, run="inspect",
                          inputs=[prompt_file, allocation, route, source.location if source.kind == "gguf" else None])
    with exclusive(folder, "inspect"):
        _inspect_locked(chosen, budget, folder, task, index, prompt_file, suite, data_dir, target_tokens, max_length,
                        model, device, dtype)


def _inspect_locked(chosen, budget, folder, task, index, prompt_file, suite, data_dir, target_tokens, max_length,
                    model, device, dtype) -> None:
    import io
    import json

    import numpy as np
    from rich.console import Console

    from ripplekv.analysis.kept import answer_positions, kept_arrays, plot_kept
    from ripplekv.engine.models import load_model, load_tokenizer
    from ripplekv.engine.prefill import Requirements, prefill_for
    from ripplekv.pipeline.samples import file_prompt, sample_prompt
    from ripplekv.runs.safeio import atomic_write

    tokenizer = load_tokenizer(model)
    if prompt_file is not None:
        prompt = file_prompt(tokenizer, prompt_file)
    else:
        prompt = sample_prompt(tokenizer, task, index, suite=suite, data_dir=data_dir, target_tokens=target_tokens,
                               max_length=max_length)
    ids, question, answers, label = prompt.ids, prompt.question_start, prompt.answers, prompt.label
    loaded, _, source = load_model(model, device=device, dtype=dtype)
    state = prefill_for(loaded, ids, Requirements.of_all([chosen]))
    built = chosen.compress(state, budget)
    arrays = kept_arrays(built)
    needles = answer_positions(ids, tokenizer, answers, question)
    meta = {"method": chosen.label, "spec": chosen.describe(), "budget": budget, "prompt_tokens": state.length,
            "question_start": question, "answer_positions": needles, "sample": label, "model": source.label}
    buffer = io.BytesIO()  # np.savez would add .npz to a temporary name: write the bytes ourselves
    np.savez_compressed(buffer, **arrays, question_start=question, answer_positions=np.asarray(needles, dtype=np.int64),
                        meta=json.dumps(meta))
    atomic_write(folder / "kept.npz", lambda tmp: tmp.write_bytes(buffer.getvalue()))
    kept_needles = int(sum(int((arrays["spans"][..., 0] <= p)[(arrays["spans"][..., 1] > p)].sum()) for p in needles))
    slots = len(needles) * arrays["counts"].size
    title = (f"{source.label}: {chosen.label} at B={budget} on {label} ({state.length} tokens, "
             f"{int(arrays['counts'].sum())} entries); answer tokens kept in {kept_needles} of {slots} (token, layer, head) slots")
    plot_kept(folder / "kept.png", arrays, state.length, question, needles, title)
    Console(stderr=True).print(f"{title}\nwrote {folder / 'kept.npz'} and {folder / 'kept.png'}")


# --- commands: methods ---


COMPOSITION_HELP = """compositions: layer allocator x head split x scorer, in one spec:
  PRESET[:allocator=LAYERS][:heads=even|adakv[:head_alpha=A]][:scorer=SCORER][:option=value...]
  layers: uniform, pyramid, file (ripplekv/depthkv, with --allocation), cake, global (Layer-DefensiveKV's);
  heads=adakv lets a layer's heads compete by the scorer's scores (AdaKV's split, safeguard head_alpha, 0.2);
  budgets stay exactly L x H_kv x B. Examples:
    ripplekv:heads=adakv:scorer=criticalkv      RippleKV layer budgets x AdaKV heads x CriticalKV scores
    ripplekv:heads=adakv:scorer=defensivekv     RippleKV layer budgets x AdaKV heads x DefensiveKV scores
    pyramidkv:heads=adakv:scorer=expected-attention
    cake:heads=adakv:scorer=keydiff             CAKE layer budgets x AdaKV heads x KeyDiff scores
    snapkv:allocator=global:scorer=criticalkv   every layer and head compete (Layer-DefensiveKV's level)
  oracle is a ceiling (answer-aware, eval only), not a method: reports mark it and leave it out of ranks."""


@app.command("methods")
def methods_command() -> None:
    """List every method: its allocator, its scorer and their options with defaults."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ripplekv.methods import ALLOCATORS, PRESETS, SCORERS
    from ripplekv.methods.presets import component_names, defaults_of

    def options(component, preset=()) -> str:
        chosen = defaults_of(component)
        chosen.update({k: v for k, v in preset if k in chosen})  # a preset's own defaults (defensivekv: alpha=0)
        return ", ".join(f"{k}={v}" for k, v in chosen.items()) or "-"

    table = Table(title="ripplekv methods (spec: name[:option=value...])", box=box.SIMPLE_HEAD)
    for column in ("method", "allocator", "scorer", "options (defaults)", "what it is"):
        table.add_column(column, overflow="fold")
    for name, chosen in sorted(PRESETS.items()):
        if chosen.is_full:
            table.add_row(name, "-", "-", "-", chosen.about)
            continue
        parts = [chosen.own.Options] if chosen.own else [ALLOCATORS[chosen.allocator], SCORERS[chosen.scorer]]
        opts = "; ".join(o for o in (options(part, chosen.options) for part in parts) if o != "-")
        table.add_row(name, *component_names(chosen), opts or "-", chosen.about)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)
    console.print(f"allocators: {', '.join(sorted(ALLOCATORS))}; scorers: {', '.join(sorted(SCORERS))} "
                  "(swap one with allocator=NAME or scorer=NAME)")
    console.print(COMPOSITION_HELP)


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

    from ripplekv.tasks.registry import task_rows

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
    if suite in (None, "longbench", "longbench-e"):
        from ripplekv.tasks.longbench import where_data_is

        console.print(where_data_is(data_dir), soft_wrap=True, markup=False)


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
