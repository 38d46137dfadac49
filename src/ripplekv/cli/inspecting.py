"""The `inspect` command: which entries one method keeps for one prompt, saved and drawn.

It builds the prompt (a suite sample or a text file), compresses it once and writes kept.npz and kept.png,
so a lost answer can be traced to the entries the method dropped. It has a module of its own because it is
the one command that loads a model for a single prompt outside the pipeline stages.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ripplekv.cli.options import (
    DECODE_BUDGET_HELP,
    DEFAULT_INSPECT,
    MAX_LENGTH,
    TARGET_TOKENS,
    Allocation,
    Budget,
    CompressEvery,
    DataDir,
    DecodeBudgetChoice,
    Device,
    Dtype,
    MaxLength,
    Model,
    Route,
    SuiteName,
    TargetTokens,
    _say_out,
    out_option,
)
from ripplekv.errors import UserError

InspectOut = out_option("Directory for kept.npz and kept.png", DEFAULT_INSPECT)


def inspect_command(
    method: str = typer.Option(..., "--method", metavar="SPEC", help="One method spec, e.g. snapkv or pyramidkv:beta=10."),
    budget: Budget = ...,
    out: InspectOut = None,
    task: str | None = typer.Option(None, "--task", help="Task of the suite (with --index)."),
    index: int = typer.Option(0, "--index", help="Sample index within the task (0-based)."),
    prompt_file: str | None = typer.Option(None, "--prompt-file", help="A text file used as the whole prompt instead."),
    suite: Annotated[SuiteName, typer.Option("--suite", help="The suite --task is from.")] = "offline",
    data_dir: DataDir = None,
    target_tokens: TargetTokens = TARGET_TOKENS,
    max_length: MaxLength = MAX_LENGTH,
    allocation: Allocation = None,
    route: Route = None,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    decode_budget: Annotated[DecodeBudgetChoice, typer.Option(
        "--decode-budget", help=DECODE_BUDGET_HELP + " With total, inspect decodes the method's own answer and saves "
        "what each head holds at its end.")] = "prompt",
    compress_every: CompressEvery = None,
) -> None:
    """Save and draw which entries a method keeps for one prompt (why did it lose the answer?)."""
    from ripplekv.engine.models import resolve_model
    from ripplekv.methods import make_method
    from ripplekv.pipeline.eval_plan import EvalSettings, check_decode_budget
    from ripplekv.pipeline.model_choice import ModelChoice
    from ripplekv.pipeline.samples import PromptChoice, check_inspect_window
    from ripplekv.runs.files import INSPECT_FILES
    from ripplekv.runs.safeio import check_output, exclusive

    chosen = make_method(method, shared={"allocation": allocation, "route": route})
    if chosen.knows_answer:  # said before any model work, whatever the spec calls its answer-aware part
        raise UserError(f"{method} is answer-aware (it needs the full cache's answer), so it runs only in "
                        "`ripplekv eval`; inspect a method that does not know the answer (e.g. snapkv)")
    if chosen.is_full and decode_budget == "total":
        raise UserError("full keeps every entry; --decode-budget total applies to a compressed method")
    decoding = check_decode_budget(EvalSettings(budgets=(budget,), decode_budget=decode_budget,
                                                compress_every=compress_every), [chosen])
    if (task is None) == (prompt_file is None):
        raise UserError("give either --task T (with --index I) or --prompt-file FILE")
    if index < 0:
        raise UserError(f"--index must be >= 0, got {index}")
    prompt = PromptChoice(task, index, prompt_file, suite, data_dir, target_tokens, max_length)
    if task is not None:  # a sliding window shorter than the prompt: said before the folder is made
        check_inspect_window(model, prompt, answer=decode_budget == "total")
    source = resolve_model(model)
    folder = check_output(out or DEFAULT_INSPECT, kind="dir", writes=INSPECT_FILES, run="inspect",
                          inputs=[prompt_file, allocation, route, source.location if source.kind == "gguf" else None])
    if out is None:  # said once the folder is known to be good, so a mistake is still one line
        from rich.console import Console

        _say_out(Console(stderr=True), "inspect", folder, False)
    with exclusive(folder, "inspect"):
        _inspect_locked(chosen, budget, folder, ModelChoice(model, device, dtype), prompt, decoding)


def _inspect_locked(chosen, budget, folder, model, prompt, decoding: dict) -> None:
    from rich.console import Console

    from ripplekv.pipeline.inspect import inspect_into

    title = inspect_into(folder, chosen, budget, model, prompt, **decoding)
    Console(stderr=True).print(f"{title}\nwrote {folder / 'kept.npz'} and {folder / 'kept.png'}")
