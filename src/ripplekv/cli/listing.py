"""The commands that list things without running a model: `budgets`, `methods` and `tasks`.

`budgets` prints each method's per-layer budgets from the model's config alone; `methods` lists every
method with its allocator, scorer and option defaults (and how to compose them); `tasks` lists the suites
and their tasks. They are grouped because each only reads registries and prints a table.
"""

from __future__ import annotations

import sys
from typing import Annotated, Literal

import typer

from ripplekv.cli.options import (
    Allocation,
    Budget,
    DataDir,
    Kernel,
    Methods,
    Model,
    Pooling,
    Route,
    SuiteName,
    Window,
    model_shape,
    snap_options,
)
from ripplekv.defaults import FORMATS
from ripplekv.errors import UserError


def budgets(
    methods: Methods = "snapkv,streamingllm,pyramidkv",
    budget: Budget = 128,
    prompt_len: int = typer.Option(3500, "--prompt-len", metavar="N", help="Prompt length n in tokens."),
    allocation: Allocation = None,
    model: Model = None,
    output_format: Annotated[Literal[FORMATS], typer.Option("--format", help="How to print the budgets.")] = "table",
    window: Window = None,
    kernel: Kernel = None,
    pooling: Pooling = None,
    route: Route = None,
) -> None:
    """Print each method's per-layer budgets, so you can see how it spends the cache."""
    from ripplekv.engine.adapter import layer_capacities, layer_windows
    from ripplekv.engine.models import load_config
    from ripplekv.methods import make_method
    from ripplekv.methods.core.spec import check_distinct, collapse_aliases, degenerate_notes
    from ripplekv.pipeline.eval_plan import parse_names

    if prompt_len <= 0:
        raise UserError(f"--prompt-len must be a positive number of tokens, got {prompt_len}")
    specs = parse_names(methods, "methods")
    note = None
    if allocation is None:  # as eval resolves it (the last `allocate`, the shipped one, ...)
        from ripplekv.engine.packaged import names_bundled
        from ripplekv.pipeline.eval_plan import default_allocation

        allocation, note = default_allocation(specs, bundled=names_bundled(model))
    shared = {**snap_options(window, kernel, pooling), "allocation": allocation, "route": route}
    chosen = [make_method(spec, shared=shared) for spec in specs]
    check_distinct(chosen)
    chosen, alias_notes = collapse_aliases(chosen)
    for note in alias_notes:
        print(note, file=sys.stderr)
    num_layers, kv_heads = model_shape(model)
    # What eval keeps: a sliding-window layer holds only its window, and budgets fit those capacities. A
    # prompt-dependent allocator shows what is known without a prompt (AdaKV: its per-layer totals) or says
    # why it cannot (CAKE: layers depend on the prompt's attention).
    capacities = layer_capacities(prompt_len, layer_windows(load_config(model)))
    rows = {m.label: m.layer_budgets(num_layers, budget, capacities) for m in chosen}
    if min(capacities) < prompt_len:
        print(f"note: sliding-window layers hold at most {min(capacities)} of the {prompt_len} prompt tokens; the "
              "budgets shown are what each layer keeps, fitted to those capacities as eval fits them", file=sys.stderr)
    for line in ([note] if note else []) + degenerate_notes(chosen, [budget]):
        print(line, file=sys.stderr)
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


COMPOSITION_HELP = """compositions: layer allocator x head split x scorer, in one spec:
  PRESET[:allocator=LAYERS][:split=even|adakv[:head_alpha=A]][:scorer=SCORER][:option=value...]
  layers: {layers}
    (file: ripplekv/depthkv's, with --allocation; global: Layer-DefensiveKV's);
  split=adakv lets a layer's heads compete by the scorer's scores (AdaKV's split, safeguard head_alpha, 0.2);
  budgets stay exactly L x H_kv x B. Examples:
    ripplekv:split=adakv:scorer=criticalkv      RippleKV layer budgets x AdaKV heads x CriticalKV scores
    ripplekv:split=adakv:scorer=defensivekv     RippleKV layer budgets x AdaKV heads x DefensiveKV scores
    pyramidkv:split=adakv:scorer=expected-attention
    cake:split=adakv:scorer=keydiff             CAKE layer budgets x AdaKV heads x KeyDiff scores
    snapkv:allocator=global:scorer=criticalkv   every layer and head compete (Layer-DefensiveKV's level)
    expected-attention:chunk_length=20          whole 20-token chunks by a scorer's scores (ChunkKV; with
                                                gate=entropy: kvpress's entropy-gated ChunkKV; segment_length=N:
                                                each N-token segment keeps its share, kvpress's ChunkPress)
  oracle is a ceiling (answer-aware, eval only), not a method: reports mark it and leave it out of ranks, and
  so is any composition that uses its scorer (snapkv:scorer=oracle:split=adakv, a route with an oracle layer)."""


def methods_command() -> None:
    """List every method: its allocator, its scorer and their options with defaults."""
    from dataclasses import fields

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ripplekv.methods import ALLOCATORS, PRESETS, SCORERS
    from ripplekv.methods.core.base import layer_allocators
    from ripplekv.methods.core.key_channels import THINK_HELP
    from ripplekv.methods.core.quant_options import QUANT_HELP
    from ripplekv.methods.core.spec import component_names, defaults_of
    from ripplekv.methods.core.thresholded import THRESHOLD_HELP
    from ripplekv.methods.core.wrapped import ENTRY_HELP

    def options(component, preset=()) -> str:
        chosen = defaults_of(component)
        # a preset's own defaults (defensivekv: alpha=0), composition options too (chunkkv: chunk_length=20)
        chosen.update({k: v for k, v in preset if k in chosen or k in {f.name for f in fields(component)}})
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
        about = chosen.about if chosen.alias_of is None else f"= {chosen.alias_of} (another name, run once): {chosen.about}"
        table.add_row(name, *component_names(chosen), opts or "-", about)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)
    console.print(f"allocators: {', '.join(sorted(ALLOCATORS))}; scorers: {', '.join(sorted(SCORERS))} "
                  "(swap one with allocator=NAME or scorer=NAME)")
    console.print(QUANT_HELP)
    console.print(THINK_HELP)
    console.print(ENTRY_HELP)
    console.print(THRESHOLD_HELP)
    console.print(COMPOSITION_HELP.format(layers=", ".join(layer_allocators())))


def tasks_command(
    suite: Annotated[SuiteName | None, typer.Option("--suite", help="Only this suite (default: all).")] = None,
    data_dir: DataDir = None,
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
