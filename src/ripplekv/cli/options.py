"""What the commands share: default output places, help strings and small option helpers.

The defaults say where each stage writes when no --out is given and where the next stage looks for it; the
help strings are reused word for word by several commands; the helpers check --workers/--ray-address, pick
the SnapKV options the user set, read a model's shape from its config, draw a progress bar and print a
command's first and last lines. They live apart from the command modules so each command imports them
without importing the app.
"""

from __future__ import annotations

from pathlib import Path

# Where each stage writes when no --out is given, and where the next stage looks for it.
DEFAULT_PROFILE = Path("runs/profile")
DEFAULT_ALLOCATION = Path("runs/allocate/allocation.csv")
DEFAULT_EVAL = Path("runs/eval")
# Samples per task `eval` takes from the offline suite without --limit: the defaults finish in minutes.
OFFLINE_FIRST_LOOK = 3


def _say_out(console, command: str, out, given: bool) -> None:
    """First line of a command: where its outputs go (and that it is the default, when it is)."""
    console.print(f"{command}: writing to {out}" + ("" if given else " (the default; choose with --out)"), soft_wrap=True)


def _say_written(console, paths) -> None:
    """Last lines of a command: every file it wrote."""
    console.print("wrote: " + ", ".join(str(p) for p in paths), soft_wrap=True)


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


ROUGE_HELP = "ROUGE-L for summarization tasks: official (LongBench parity, default) or rouge-score (Google's, as HELM)."
DECODE_BUDGET_HELP = (
    "prompt: B counts prompt entries, decoded tokens are added on top (the default, as the papers); total: "
    "prompt entries + decoded tokens stay at B per layer and KV head at every step, each method evicting by "
    "its own scores (h2o, tova, streamingllm and the SnapKV-scored methods; others are refused).")
COMPRESS_EVERY_HELP = ("With --decode-budget total: the SnapKV-scored methods score the held entries again every N "
                       "decoded tokens (default 8; 1 = every step); H2O, TOVA and StreamingLLM evict by their own "
                       "scores at every step.")
