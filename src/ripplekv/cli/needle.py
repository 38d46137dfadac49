"""`ripplekv needle`: the needle heatmap (accuracy and KL by needle depth x context length, a panel per method)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ripplekv.cli.options import (
    MAX_LENGTH,
    METHODS_HELP,
    Budgets,
    Device,
    Dtype,
    MaxLength,
    Model,
    SuiteName,
    _say_written,
    out_option,
    seed_option,
)
from ripplekv.defaults import DEFAULT_EVAL_METHODS, NEEDLE_LENGTHS, NEEDLE_TASK

DEFAULT_NEEDLE = Path("runs/needle")
NeedleOut = out_option("Folder of the per-length eval runs (tokens-N/) and the heatmap", DEFAULT_NEEDLE)


def needle_command(
    budget: Budgets,
    lengths: str = typer.Option(",".join(map(str, NEEDLE_LENGTHS)), "--lengths", metavar="N,N",
                                help="Context lengths in tokens (the --target-tokens of each run)."),
    methods: str = typer.Option(",".join(DEFAULT_EVAL_METHODS), "--methods", metavar="SPECS",
                                help=METHODS_HELP + " full is always included."),
    task: str = typer.Option(NEEDLE_TASK, "--task", help="A needle task: niah_depths (RULER's niah_single_2, the "
                             "needle at depths 0-100% in turn) or any RULER niah task (random depths)."),
    suite: Annotated[SuiteName, typer.Option("--suite", help="The suite of --task.")] = "ruler",
    limit: int = typer.Option(11, "--limit", help="Samples per length (niah_depths: 11 = every depth once)."),
    depth_step: int = typer.Option(10, "--depth-step", metavar="PCT", help="Heatmap rows: depth rounded to this step."),
    allocation: str | None = typer.Option(None, "--allocation", metavar="CSV",
                                          help="Allocation CSV for methods with file budgets (ripplekv, ...)."),
    model: Model = None,
    max_length: MaxLength = MAX_LENGTH,
    out: NeedleOut = None,
    seed: Annotated[int, seed_option("the generated samples")] = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """Accuracy and KL over needle depth x context length, one heatmap panel per method at each budget."""
    from rich.console import Console

    from ripplekv.engine.packaged import names_bundled
    from ripplekv.pipeline import eval_plan
    from ripplekv.pipeline.needle import parse_lengths, run_needle

    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_NEEDLE
    names = eval_plan.parse_names(methods, "methods")
    if allocation is None:  # the one rule of eval, budgets and the API
        allocation, note = eval_plan.default_allocation(names, bundled=names_bundled(model))
        if note:
            console.print(note, soft_wrap=True)
    settings = eval_plan.EvalSettings(
        budgets=eval_plan.parse_budgets(budget), methods=names, suite=suite, tasks=(task,), limit=limit,
        allocation=allocation, model=model, max_length=max_length, seed=seed, device=device, dtype=dtype,
    )
    console.print(f"needle: writing to {out_dir}" + ("" if out else " (the default; choose with --out)"), soft_wrap=True)
    written = run_needle(settings, parse_lengths(lengths), out_dir, console=console, depth_step=depth_step)
    _say_written(console, written)
