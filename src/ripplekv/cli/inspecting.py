"""The `inspect` command: which entries one method keeps for one prompt, saved and drawn.

It builds the prompt (a suite sample or a text file), compresses it once and writes kept.npz and kept.png,
so a lost answer can be traced to the entries the method dropped. It has a module of its own because it is
the one command that loads a model for a single prompt outside the pipeline stages.
"""

from __future__ import annotations

import typer

from ripplekv.cli.options import COMPRESS_EVERY_HELP, DECODE_BUDGET_HELP, DEVICE_HELP, DTYPE_HELP, ROUTE_HELP
from ripplekv.errors import UserError


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
    decode_budget: str = typer.Option("prompt", "--decode-budget", help=DECODE_BUDGET_HELP + " With total, inspect "
                                      "decodes the method's own answer and saves what each head holds at its end."),
    compress_every: int | None = typer.Option(None, "--compress-every", help=COMPRESS_EVERY_HELP),
) -> None:
    """Save and draw which entries a method keeps for one prompt (why did it lose the answer?)."""
    from ripplekv.engine.models import resolve_model
    from ripplekv.methods import make_method
    from ripplekv.methods.budgets import check_budget
    from ripplekv.pipeline.eval_plan import EvalSettings, check_decode_budget
    from ripplekv.runs.files import INSPECT_FILES
    from ripplekv.runs.safeio import check_output, exclusive

    check_budget(budget)
    chosen = make_method(method, shared={"allocation": allocation, "route": route})
    if chosen.is_full and decode_budget == "total":
        raise UserError("full keeps every entry; --decode-budget total applies to a compressed method")
    decoding = check_decode_budget(EvalSettings(budgets=(budget,), decode_budget=decode_budget,
                                                compress_every=compress_every), [chosen])
    if (task is None) == (prompt_file is None):
        raise UserError("give either --task T (with --index I) or --prompt-file FILE")
    if index < 0:
        raise UserError(f"--index must be >= 0, got {index}")
    source = resolve_model(model)
    folder = check_output(out, kind="dir", writes=INSPECT_FILES, run="inspect",
                          inputs=[prompt_file, allocation, route, source.location if source.kind == "gguf" else None])
    with exclusive(folder, "inspect"):
        _inspect_locked(chosen, budget, folder, task, index, prompt_file, suite, data_dir, target_tokens, max_length,
                        model, device, dtype, decoding)


def _inspect_locked(chosen, budget, folder, task, index, prompt_file, suite, data_dir, target_tokens, max_length,
                    model, device, dtype, decoding: dict) -> None:
    from rich.console import Console

    from ripplekv.pipeline.inspect import inspect_into

    title = inspect_into(folder, chosen, budget, model, task=task, index=index, prompt_file=prompt_file, suite=suite,
                         data_dir=data_dir, target_tokens=target_tokens, max_length=max_length, device=device,
                         dtype=dtype, **decoding)
    Console(stderr=True).print(f"{title}\nwrote {folder / 'kept.npz'} and {folder / 'kept.png'}")
