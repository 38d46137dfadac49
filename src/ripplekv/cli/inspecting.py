"""The `inspect` command: which entries one method keeps for one prompt, saved and drawn.

It builds the prompt (a suite sample or a text file), compresses it once and writes kept.npz and kept.png,
so a lost answer can be traced to the entries the method dropped. It has a module of its own because it is
the one command that loads a model for a single prompt outside the pipeline stages.
"""

from __future__ import annotations

import typer

from ripplekv.cli.options import DEVICE_HELP, DTYPE_HELP, ROUTE_HELP
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
