"""What the commands share: their options' declarations, default output places and small option helpers.

Every option that more than one command takes is declared here once, as an `Annotated` type (name, metavar,
choices, help), so it means the same and takes the same form on every command; a fixed set of values is a
`Literal` of the tuple in ripplekv.defaults that the libraries check too, so --help lists it and a wrong
value fails while parsing. The defaults say where each stage writes when no --out is given and where the
next stage looks for it. The helpers check --workers/--ray-address and --budget, pick the SnapKV options
the user set, read a model's shape from its config, draw a progress bar and print a command's first and
last lines. They live apart from the command modules so each command imports them without importing the app.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from ripplekv.defaults import (
    DECODE_BUDGETS,
    DEFAULT_BLOCK_TOKENS,
    DTYPES,
    LAST_ALLOCATION,
    POOLINGS,
    PROBE_TOKENS,
    PROTOCOLS,
    ROUGE_CHOICES,
    SUITES,
)
from ripplekv.errors import UserError, cli_flag

# Where each stage writes when no --out is given, and where the next stage looks for it.
DEFAULT_PROFILE = Path("runs/profile")
DEFAULT_ALLOCATION = LAST_ALLOCATION
DEFAULT_EVAL = Path("runs/eval")
# Samples per task `eval` takes from the offline suite without --limit: the defaults finish in minutes.
OFFLINE_FIRST_LOOK = 3
DEFAULT_ROUTE = Path("runs/route")
DEFAULT_INSPECT = Path("runs/inspect")
DEFAULT_SCORE = Path("runs/score/scores.csv")


# A setting's flag where it is not the setting's name with dashes (`memory_budget` -> `--memory-budget`).
flag = cli_flag  # the command-line flag of a setting a message names (`errors.UserError`)


def _say_out(console, command: str, out, given: bool) -> None:
    """First line of a command: where its outputs go (and that it is the default, when it is)."""
    console.print(f"{command}: writing to {out}" + ("" if given else " (the default; choose with --out)"), soft_wrap=True)


def _say_written(console, paths) -> None:
    """Last lines of a command: every file it wrote."""
    console.print("wrote: " + ", ".join(str(p) for p in paths), soft_wrap=True)


# --------------------------------------------------------------------------- shared option declarations

BUDGET_HELP = "Average prompt entries kept per layer per KV head."
WINDOW_HELP = "SnapKV observation window (always kept); default 32."
KERNEL_HELP = "SnapKV pooling kernel; default 7."
POOLING_HELP = "SnapKV pooling; default max."
METHODS_HELP = "Comma-separated method specs, e.g. snapkv,pyramidkv:beta=10,ripplekv:scorer=random (`ripplekv methods`)."
MODEL_HELP = "Hub id, model directory or .gguf; default: the bundled SmolLM2-135M."
ROUTE_HELP = "Route CSV (layer,method) for the routed method."
ALLOCATION_HELP = "Allocation CSV (layer,multiplier) for the methods with file budgets (ripplekv, depthkv, routed-ripplekv)."
DATA_DIR_HELP = "Folder (or data.zip) of the official LongBench files."
TARGET_TOKENS_HELP = ("Length in tokens of the prompts built from the offline suite (calibration prompts too); on the "
                      "ruler suite RULER's --max_seq_length (task text plus its generation length, at most this).")
MAX_LENGTH_HELP = "Prompts longer than this are truncated in the middle."
CALIB_SAMPLES_HELP = "Calibration prompts (the offline suite's calibration split, disjoint from eval's samples)."
CALIB_DRAW_HELP = ("Which of the --calib-draws disjoint draws of the calibration split to calibrate on (0 = the first; "
                   "sample i of every task belongs to draw i mod N).")
CALIB_DRAWS_HELP = "How many disjoint draws the calibration split is dealt into (1: the whole split)."
PROBE_TOKENS_HELP = "Final prompt tokens used as probes (the question)."
WITH_ANSWER_HELP = "Also teacher-force the reference answer as probes."
DEVICE_HELP = "auto (CUDA when a GPU is there, else CPU), cpu, cuda or cuda:N."
DTYPE_HELP = "auto: bfloat16 on CUDA, float32 on CPU."
WORKERS_HELP = "Ray workers, each loading the model once (one GPU each on CUDA, else a share of the cores)."
RAY_ADDRESS_HELP = "Join a running Ray cluster (`ray start --head`) instead of starting a local one."
ROUGE_HELP = "ROUGE-L for summarization tasks: official (LongBench parity) or rouge-score (Google's, as HELM)."
PROTOCOL_HELP = ("with-question: compress the whole prompt (as the LongBench papers); context-only: compress the "
                 "context, then read the question through the compressed cache (a cache reused across questions); "
                 "multi-question: compress the context once and ask it each of its questions (tasks with several: "
                 "niah_multiquestion, squad_multiquestion, SCBench's); multi-question-first: the same, the first "
                 "question in the observation window; blockwise: read the whole prompt in blocks of --block-tokens, "
                 "each method evicting to its budget after every block (KeyDiff's setting, kvpress BlockPress), so its "
                 "prefill never holds more than budget + block entries per head: a protocol, not a method (compare "
                 "methods under one protocol at a time), and it costs one prefill per variant, not per sample.")
BLOCK_TOKENS_HELP = ("With --protocol blockwise: tokens per block (at least a method's observation window). Default: "
                     f"{DEFAULT_BLOCK_TOKENS}.")

SuiteName = Literal[SUITES]

# One budget (`budgets`, `inspect`, `allocate`, `route`); eval takes several in the same form.
def budget_option(note: str = ""):
    """`--budget` of a command that takes one (checked as eval checks each of its budgets); `note`: what it is for there."""
    return Annotated[int, typer.Option("--budget", metavar="B", parser=lambda text: one_budget(text),
                                       help=BUDGET_HELP + (" " + note if note else ""))]


Budget = budget_option()
Budgets = Annotated[list[str], typer.Option("--budget", metavar="B",
                                            help=BUDGET_HELP[:-1] + " (with --decode-budget total, prompt + decoded); "
                                                 "repeat or comma-separate (128,256).")]
Methods = Annotated[str, typer.Option("--methods", metavar="SPECS", help=METHODS_HELP)]
Model = Annotated[str | None, typer.Option("--model", metavar="MODEL", help=MODEL_HELP)]
Allocation = Annotated[str | None, typer.Option("--allocation", metavar="CSV", help=ALLOCATION_HELP)]
Route = Annotated[str | None, typer.Option("--route", metavar="CSV", help=ROUTE_HELP)]
Window = Annotated[int | None, typer.Option("--window", metavar="N", help=WINDOW_HELP)]
Kernel = Annotated[int | None, typer.Option("--kernel", metavar="N", help=KERNEL_HELP)]
Pooling = Annotated[Literal[POOLINGS] | None, typer.Option("--pooling", help=POOLING_HELP)]
DataDir = Annotated[str | None, typer.Option("--data-dir", metavar="DIR", help=DATA_DIR_HELP)]
TargetTokens = Annotated[int, typer.Option("--target-tokens", metavar="N", help=TARGET_TOKENS_HELP)]
MaxLength = Annotated[int, typer.Option("--max-length", metavar="N", help=MAX_LENGTH_HELP)]
CalibSamples = Annotated[int, typer.Option("--calib-samples", metavar="N", help=CALIB_SAMPLES_HELP)]
CalibDraw = Annotated[int, typer.Option("--calib-draw", metavar="I", help=CALIB_DRAW_HELP)]
CalibDraws = Annotated[int, typer.Option("--calib-draws", metavar="N", help=CALIB_DRAWS_HELP)]
CalibTasks = Annotated[str | None, typer.Option(
    "--calib-tasks", metavar="TASKS", help="Calibrate on these tasks' calibration splits: offline task names or "
    "SUITE:TASK for RULER (e.g. ruler:vt,hotpotqa); default: every offline task.")]
ProbeTokens = Annotated[int, typer.Option("--probe-tokens", metavar="N", help=PROBE_TOKENS_HELP)]
WithAnswer = Annotated[bool, typer.Option("--with-answer", help=WITH_ANSWER_HELP)]
Device = Annotated[str, typer.Option("--device", metavar="DEVICE", help=DEVICE_HELP)]
Dtype = Annotated[Literal[DTYPES], typer.Option("--dtype", case_sensitive=False, help=DTYPE_HELP)]
Workers = Annotated[int, typer.Option("--workers", metavar="N", help=WORKERS_HELP)]
RayAddress = Annotated[str | None, typer.Option("--ray-address", metavar="HOST:PORT", help=RAY_ADDRESS_HELP)]
Rouge = Annotated[Literal[ROUGE_CHOICES], typer.Option("--rouge", help=ROUGE_HELP)]
Protocol = Annotated[Literal[PROTOCOLS], typer.Option("--protocol", help=PROTOCOL_HELP)]
BlockTokens = Annotated[int | None, typer.Option("--block-tokens", metavar="N", help=BLOCK_TOKENS_HELP)]

# Option defaults that several commands share.
TARGET_TOKENS = 3500
MAX_LENGTH = 7500
DEFAULT_PROBE_TOKENS = PROBE_TOKENS


def out_option(what: str, default: Path, metavar: str = "DIR"):
    """`--out` of a command: optional everywhere, `default` when not given (the command says so)."""
    return Annotated[str | None, typer.Option("--out", metavar=metavar, help=f"{what}; default: {default}.")]


def seed_option(what: str):
    """`--seed` of a command: an integer, 0 by default (what every command did before it had the option)."""
    return Annotated[int, typer.Option("--seed", metavar="N", help=f"Seed of {what}.")]


def one_budget(text) -> int:
    """--budget of a command that takes one: the same form as eval's (a positive integer), one value only."""
    from ripplekv.pipeline.eval_plan import parse_budgets

    values = parse_budgets([text])
    if len(values) != 1:
        raise UserError(f"--budget takes one budget here, got {text!r}; only eval takes several")
    return values[0]


def calibration(samples: int, draw: int, draws: int, target_tokens: int, with_answer: bool = False,
                tasks: str | None = None):
    """--calib-samples, --calib-draw/--calib-draws, --target-tokens, --calib-tasks (and --with-answer) as one
    checked `Calibration`: the calibration prompts every fitted stage reads."""
    from ripplekv.pipeline.eval_plan import parse_names
    from ripplekv.tasks.calibration import Calibration, Draw

    chosen = parse_names(tasks, "--calib-tasks") if tasks is not None else ()
    return Calibration(samples, target_tokens, Draw(draw, draws), with_answer, chosen).check()


def check_extensions(max_extensions: int) -> int:
    """--max-extensions of the stages that search a grid (allocate's ratio, tune's knobs)."""
    if max_extensions < 0:
        raise UserError(f"--max-extensions must be 0 or more, got {max_extensions}")
    return max_extensions


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
    from ripplekv.engine.config_shape import config_shape

    shape = config_shape(model)
    return shape.layers, shape.kv_heads



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

DECODE_BUDGET_HELP = (
    "prompt: B counts prompt entries, decoded tokens are added on top (the default, as the papers); total: "
    "prompt entries + decoded tokens stay at B per layer and KV head at every step, each method evicting by "
    "its own scores (h2o, tova, streamingllm and the SnapKV-scored methods; others are refused).")
COMPRESS_EVERY_HELP = ("With --decode-budget total: the SnapKV-scored methods score the held entries again every N "
                       "decoded tokens (default 8; 1 = every step); H2O, TOVA and StreamingLLM evict by their own "
                       "scores at every step.")
DecodeBudgetChoice = Literal[DECODE_BUDGETS]
DecodeBudget = Annotated[DecodeBudgetChoice, typer.Option("--decode-budget", help=DECODE_BUDGET_HELP)]
CompressEvery = Annotated[int | None, typer.Option("--compress-every", metavar="N", help=COMPRESS_EVERY_HELP)]
MemoryBudget = Annotated[str | None, typer.Option(
    "--memory-budget", metavar="SIZE",
    help="Bytes a sample may hold, weights included, e.g. 40GiB or 500MB: the variants decoded together (built "
         "when their group decodes) are sized to fit beside what the sample holds as measured (GPU: allocated "
         "tensors; CPU: the resident set), planned again after each group; the prefill itself runs before them, "
         "unbounded. Default: most of the free GPU memory, or of the available RAM. Never changes results.")]
