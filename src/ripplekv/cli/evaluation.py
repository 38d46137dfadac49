"""The commands that score methods: `eval`, `report` and `score`.

`eval` runs every method at every budget into a run directory (with `eval_plan.default_allocation` choosing
the allocation when none is given), `report` re-renders a run's tables and plots from its predictions alone, and
`score` applies the LongBench metrics to any predictions file. They are grouped because they make and read
the same predictions and scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ripplekv.cli.options import (
    DEFAULT_ALLOCATION,
    DEFAULT_EVAL,
    DEFAULT_SCORE,
    MAX_LENGTH,
    METHODS_HELP,
    OFFLINE_FIRST_LOOK,
    TARGET_TOKENS,
    BlockTokens,
    Budgets,
    CompressEvery,
    DataDir,
    DecodeBudget,
    Device,
    Dtype,
    Kernel,
    MaxLength,
    MemoryBudget,
    Model,
    Pooling,
    Protocol,
    RayAddress,
    Rouge,
    Route,
    SuiteName,
    TargetTokens,
    Window,
    Workers,
    _say_out,
    out_option,
    seed_option,
    snap_options,
    worker_settings,
)
from ripplekv.defaults import DEFAULT_EVAL_METHODS, EVAL_BATCH_SIZE, GENERATED_SUITES

EvalOut = out_option("Run directory; a rerun resumes it and adds what is new", DEFAULT_EVAL)
ScoreOut = out_option("Per-dataset CSV: dataset,n,score,metric (+ rows <dataset>@0-4k/@4-8k/@8k+ for *_e)", DEFAULT_SCORE,
                      "CSV")
EvalSeed = seed_option("the offline suite's generated samples (0: the published ones)")
ReportSeed = seed_option("the bootstrap resamples and the sign-flip test's random patterns")


def eval_command(
    budget: Budgets,
    out: EvalOut = None,
    methods: str = typer.Option(",".join(DEFAULT_EVAL_METHODS), "--methods", metavar="SPECS",
                                help=METHODS_HELP + " full is always included."),
    suite: Annotated[SuiteName | None, typer.Option(
        "--suite", help="offline and ruler are generated here; default: longbench when its files are on disk, "
                        "else offline.")] = None,
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated tasks of the suite (default: all)."),
    limit: int | None = typer.Option(
        None, "--limit",
        help=f"At most N samples per task; default: {OFFLINE_FIRST_LOOK} on the generated suites, offline and ruler "
             "(a first look in minutes; a rerun with a higher --limit adds samples), all on LongBench."),
    split: str = typer.Option(
        "eval", "--split",
        help="eval, or calibration: the generated suites' calibration prompts (disjoint from eval's), for a task "
             "screen that must not look at evaluation samples."),
    allocation: str | None = typer.Option(
        None, "--allocation", metavar="CSV",
        help=f"Allocation CSV for ripplekv (and depthkv, routed-ripplekv); default: {DEFAULT_ALLOCATION}, else the one shipped for the bundled model."),
    model: Model = None,
    data_dir: DataDir = None,
    target_tokens: TargetTokens = TARGET_TOKENS,
    max_length: MaxLength = MAX_LENGTH,
    batch_size: int = typer.Option(EVAL_BATCH_SIZE, "--batch-size", help="Variants per teacher-forced pass (KL, agreement); variants of similar kept length go together, within --memory-budget; after its divergence a variant decodes on in its group."),
    window: Window = None,
    kernel: Kernel = None,
    pooling: Pooling = None,
    route: Route = None,
    protocol: Protocol = "with-question",
    block_tokens: BlockTokens = None,
    decode_budget: DecodeBudget = "prompt",
    compress_every: CompressEvery = None,
    memory_budget: MemoryBudget = None,
    seed: EvalSeed = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
    workers: Workers = 1,
    ray_address: RayAddress = None,
) -> None:
    """Score every method at every budget: one prefill per sample, all variants decoded from it."""
    from rich.console import Console

    from ripplekv.engine.memory import parse_bytes
    from ripplekv.engine.packaged import names_bundled
    from ripplekv.pipeline import eval_plan, evaluate
    from ripplekv.tasks.registry import default_suite

    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_EVAL
    names = eval_plan.parse_names(methods, "methods")
    notes = [f"eval: writing to {out_dir}" + ("" if out else " (the default; choose with --out)")]
    if allocation is None:
        allocation, note = eval_plan.default_allocation(names, bundled=names_bundled(model))
        notes += [note] if note else []
    suite = suite or default_suite(data_dir)
    settings = eval_plan.EvalSettings(
        budgets=eval_plan.parse_budgets(budget),
        methods=names,
        suite=suite,
        tasks=eval_plan.parse_names(tasks, "tasks"),
        limit=OFFLINE_FIRST_LOOK if limit is None and suite in GENERATED_SUITES else limit,
        split=split,
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
        block_tokens=block_tokens,
        seed=seed,
        decode_budget=decode_budget,
        compress_every=compress_every,
        memory_budget=None if memory_budget is None else parse_bytes(memory_budget),
    )
    tables = evaluate.run_eval(settings, out_dir, console=console, notes=notes,
                               workers=worker_settings(workers, ray_address))
    print_tables(tables, out_dir)


def report_command(
    run_dir: str | None = typer.Argument(None, help="A directory written by `ripplekv eval`."),
    rouge: Rouge = "official",
    resamples: int = typer.Option(2000, "--resamples", help="Paired bootstrap resamples for rank probabilities (intervals are t intervals, p-values sign-flip tests)."),
    seed: ReportSeed = 0,
    html: bool = typer.Option(True, "--html/--no-html", help="Write index.html: the leaderboard and plots as one self-contained web page."),
    compare: tuple[str, str] | None = typer.Option(None, "--compare", metavar="RUN_A RUN_B",
                                                   help="Write one page putting two runs side by side (with --out), rankings paired."),
    site: str | None = typer.Option(None, "--site", metavar="DIR",
                                    help="Write DIR/index.html linking a page for every eval run and needle folder under DIR (their pages rewritten)."),
    out: str | None = typer.Option(None, "--out", metavar="DIR", help="The folder of --compare's page."),
    questions: bool = typer.Option(False, "--questions", help="With --site: rebuild each sample's question from its "
                                   "suite for runs whose lines predate eval recording it (loads each model's tokenizer)."),
) -> None:
    """Re-render scores.csv, leaderboards (with 95% intervals and tests), plots, summary.md and index.html from predictions.jsonl alone."""
    from ripplekv.analysis import report
    from ripplekv.errors import UserError
    from ripplekv.methods.core.catalog import method_notes
    from ripplekv.methods.fit_records import run_fit_records
    from ripplekv.metrics.rouge import check_rouge
    from ripplekv.runs.safeio import exclusive

    chosen = [name for name, given in (("RUN_DIR", run_dir), ("--compare", compare), ("--site", site)) if given]
    if len(chosen) != 1:
        raise UserError("give one of: a run folder (ripplekv report RUN), --compare RUN_A RUN_B --out DIR, or --site DIR"
                        + (f" (got {', '.join(chosen)})" if chosen else ""))
    if out is not None and compare is None:
        raise UserError("--out names the folder of --compare's page; a run's page goes into its own folder")
    if questions and site is None:
        raise UserError("--questions applies to --site (a run's own report shows the questions its lines carry)")
    if compare is not None or site is not None:
        _write_pages(compare, out, site, questions)
        return
    check_rouge(rouge)
    with exclusive(report.check_run_folder(run_dir), "report", elsewhere=None):  # an eval still writing this run would change it under us
        tables = report.render(run_dir, rouge=rouge, resamples=resamples, seed=seed, html=html, notes=method_notes(),
                               fits=run_fit_records(run_dir))
    print_tables(tables, run_dir)
    if html:
        from rich.console import Console

        Console(stderr=True).print(f"wrote {Path(run_dir) / 'index.html'}", soft_wrap=True)


def _write_pages(compare: tuple[str, str] | None, out: str | None, site: str | None, questions: bool) -> None:
    """`report --compare` and `report --site`: pages only, from files the reports already wrote."""
    from rich.console import Console

    from ripplekv.analysis.html_page import write_compare_page, write_site
    from ripplekv.errors import UserError
    from ripplekv.methods.core.catalog import method_notes

    if compare is not None:
        if out is None:
            raise UserError("--compare needs --out DIR, the folder its index.html goes into")
        written = write_compare_page(compare[0], compare[1], out)
    else:
        rebuilt = None
        if questions:
            from ripplekv.pipeline.pages import rebuilt_questions

            tokenizers: dict = {}
            rebuilt = lambda folder: rebuilt_questions(folder, tokenizers)  # noqa: E731
        written = write_site(site, notes=method_notes(), questions=rebuilt)
    Console(stderr=True).print(f"wrote {written}", soft_wrap=True)


def print_tables(tables: dict, run_dir) -> None:
    """The leaderboard and, when the run has timings, where its time went."""
    from rich.console import Console

    from ripplekv.analysis import summary, time_spent

    console = Console()
    console.print(summary.summary_table(tables["leaderboard"], title=f"kl (score): {run_dir}"))
    if tables.get("time") is not None:
        console.print(time_spent.time_rich_table(tables["time"], title=f"where the time went: {run_dir}"))



def score(
    pred_file: str = typer.Argument(
        ..., help="JSON lines {dataset, pred, answers, all_classes[, length]} (length needed for *_e), "
                  "or the predictions.jsonl of `ripplekv eval` (scored per method and budget)."
    ),
    out: ScoreOut = None,
    samples: str | None = typer.Option(None, "--samples", metavar="CSV", help="Per-sample CSV: line (0-based),dataset,score."),
    rouge: Rouge = "official",
) -> None:
    """Score a predictions file with the official LongBench metrics (also rescores other tools' outputs)."""
    from pathlib import Path

    import pandas as pd
    from rich.console import Console
    from rich.table import Table

    from ripplekv.metrics.rouge import check_rouge
    from ripplekv.metrics.scoring import read_prediction_file, score_predictions
    from ripplekv.runs.safeio import check_output, write_csv

    rouge = check_rouge(rouge)
    given, out = out is not None, out or str(DEFAULT_SCORE)
    check_output(out, inputs=[pred_file])
    if samples is not None:
        check_output(samples, inputs=[pred_file, out], option="--samples")
    datasets, per_sample = score_predictions(read_prediction_file(Path(pred_file)), rouge)
    if not given:  # said once the input is known to be good, so a mistake is still one line
        _say_out(Console(stderr=True), "score", out, False)
    write_csv(out, datasets)
    if samples is not None:
        write_csv(samples, per_sample)

    table = Table(title=f"LongBench scores: {pred_file}")
    for column in datasets.columns:
        table.add_column(column, justify="left" if column in ("dataset", "method") else "right")
    for row in datasets.to_dict("records"):
        table.add_row(*("" if pd.isna(v) else f"{v:.2f}" if k == "score" else str(v) for k, v in row.items()))
    Console().print(table)
