"""The commands that score methods: `eval`, `report` and `score`.

`eval` runs every method at every budget into a run directory (with `default_allocation` choosing the
allocation when none is given), `report` re-renders a run's tables and plots from its predictions alone, and
`score` applies the LongBench metrics to any predictions file. They are grouped because they make and read
the same predictions and scores.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ripplekv.cli.options import (
    COMPRESS_EVERY_HELP,
    DECODE_BUDGET_HELP,
    DEFAULT_ALLOCATION,
    DEFAULT_EVAL,
    DEVICE_HELP,
    DTYPE_HELP,
    KERNEL_HELP,
    METHODS_HELP,
    OFFLINE_FIRST_LOOK,
    POOLING_HELP,
    RAY_ADDRESS_HELP,
    ROUGE_HELP,
    ROUTE_HELP,
    WINDOW_HELP,
    WORKERS_HELP,
    snap_options,
    worker_settings,
)
from ripplekv.defaults import DEFAULT_EVAL_METHODS


def eval_command(
    budget: list[str] = typer.Option(
        ..., "--budget", metavar="B",
        help="Average entries kept per layer per KV head (prompt entries; with --decode-budget total, prompt + decoded); repeat or comma-separate (128,256).",
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
    decode_budget: str = typer.Option("prompt", "--decode-budget", help=DECODE_BUDGET_HELP),
    compress_every: int | None = typer.Option(None, "--compress-every", help=COMPRESS_EVERY_HELP),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    workers: int = typer.Option(1, "--workers", help=WORKERS_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Score every method at every budget: one prefill per sample, all variants decoded from it."""
    from rich.console import Console

    from ripplekv.analysis import summary
    from ripplekv.pipeline import eval_plan, evaluate
    from ripplekv.tasks.registry import default_suite

    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_EVAL
    names = eval_plan.parse_names(methods, "--methods")
    notes = [f"eval: writing to {out_dir}" + ("" if out else " (the default; choose with --out)")]
    from ripplekv.methods.presets import options_taken

    if allocation is None and "allocation" in options_taken(names):
        allocation, note = default_allocation(model)
        notes += [note] if note else []
    suite = suite or default_suite(data_dir)
    settings = eval_plan.EvalSettings(
        budgets=eval_plan.parse_budgets(budget),
        methods=names,
        suite=suite,
        tasks=eval_plan.parse_names(tasks, "--tasks"),
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
        decode_budget=decode_budget,
        compress_every=compress_every,
    )
    tables = evaluate.run_eval(settings, out_dir, console=console, notes=notes,
                               workers=worker_settings(workers, ray_address))
    Console().print(summary.summary_table(tables["leaderboard"], title=f"average score (kl): {out_dir}"))


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


def report_command(
    run_dir: str = typer.Argument(..., help="A directory written by `ripplekv eval`."),
    rouge: str = typer.Option("official", "--rouge", help=ROUGE_HELP),
    resamples: int = typer.Option(2000, "--resamples", help="Bootstrap resamples for intervals, p-values and rank probabilities."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap resamples."),
) -> None:
    """Re-render scores.csv, leaderboards (with 95% intervals and tests), plots and summary.md from predictions.jsonl alone."""
    from rich.console import Console

    from ripplekv.analysis import report, summary
    from ripplekv.metrics.rouge import check_rouge
    from ripplekv.runs.safeio import exclusive

    check_rouge(rouge)
    with exclusive(report.check_run_folder(run_dir), "report"):  # an eval still writing this run would change it under us
        tables = report.render(run_dir, rouge=rouge, resamples=resamples, seed=seed)
    Console().print(summary.summary_table(tables["leaderboard"], title=f"average score (kl): {run_dir}"))



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
