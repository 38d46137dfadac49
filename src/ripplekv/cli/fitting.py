"""`ripplekv fit`: a method's learned parts fitted on calibration prompts, one subcommand per method.

`fit lukv` profiles LU-KV's head-budget curves, `fit kvzap` KVzap's surrogates, `fit fastkvzip` FastKVzip's
gates, `fit qfilter` Q-Filters' filters, `fit compresskv` CompressKV's layer profile and `fit duoattention`
DuoAttention's head gates; each reads the offline suite's calibration split (never the evaluated samples) through
one `Calibration` (--calib-samples, --calib-draw/--calib-draws, --target-tokens), shows a progress bar and hands
the work to ripplekv.pipeline. The long ones resume: lukv, kvzap, fastkvzip and qfilter compute only the prompts
not yet in OUT/samples.jsonl, duoattention goes on from its last checkpointed step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from ripplekv.cli.options import (
    TARGET_TOKENS,
    CalibDraw,
    CalibDraws,
    CalibSamples,
    CalibTasks,
    Device,
    Dtype,
    Model,
    TargetTokens,
    _progress_bar,
    _say_out,
    _say_written,
    budget_option,
    calibration,
)

fit_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Fit a method's learned parts on calibration prompts: LU-KV's head-budget curves (lukv), KVzap's "
         "surrogates (kvzap), FastKVzip's gates (fastkvzip), Q-Filters' filters (qfilter), CompressKV's layer profile "
         "(compresskv), DuoAttention's head gates (duoattention).",
)

FitDir = Annotated[str, typer.Option("--out", metavar="DIR", help="The folder for the fitted files and the resumable "
                                                                  "log; rerun the same command to resume.")]

LayerBudget = budget_option("CompressKV measures each layer's error at this selection.")


def _bar(total: int, done: int):
    return _progress_bar("calibration prompts", total, done)


@fit_app.command("lukv")
def fit_lukv(
    out: FitDir,
    methods: str = typer.Option("lukv,lukv:scorer=snapkv", "--methods", metavar="SPECS",
                                help="LU-KV method specs, one curve per scorer."),
    model: Model = None,
    calib_samples: CalibSamples = 8,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    target_tokens: TargetTokens = TARGET_TOKENS,
    answer_tokens: int = typer.Option(64, "--answer-tokens", metavar="N",
                                      help="The full cache's answer read for the oracle."),
    per_layer: bool = typer.Option(False, "--per-layer", help="One greedy per layer (default: all layers at once)."),
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """LU-KV's head-budget curves: OUT/curve-SCORER.csv (+ .json), read as SPEC:curve=FILE.

    Each calibration prompt is prefilled once; the full cache's greedy answer (at most --answer-tokens) is read
    back through the full cache for every entry's oracle importance, each scorer ranks the entries, and LU-KV's
    greedy gives the prompt's per-head prune ratios at 99 global ratios; the curve is their mean over prompts."""
    from rich.console import Console

    from ripplekv.pipeline.head_curves import CurveSettings, profile_curves
    from ripplekv.pipeline.model_choice import ModelChoice

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    console = Console(stderr=True)
    start = time.perf_counter()
    written = profile_curves(Path(out), ModelChoice(model, device, dtype),
                             [s.strip() for s in methods.split(",") if s.strip()],
                             CurveSettings(answer_tokens, not per_layer), chosen, bar=_bar,
                             announce=lambda: _say_out(console, "fit lukv", out, True))
    for name, path in written.items():
        console.print(f"curve of {name}: {path}", soft_wrap=True)
    console.print(f"fit lukv: done in {time.perf_counter() - start:.1f} s")
    _say_written(console, [p for path in written.values() for p in (path, path.with_suffix(".json"))])


@fit_app.command("kvzap")
def fit_kvzap(
    out: FitDir,
    models: str = typer.Option("mlp,linear", "--models", metavar="KINDS", help="Surrogate kinds to fit (mlp, linear)."),
    model: Model = None,
    calib_samples: CalibSamples = 16,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    target_tokens: Annotated[int, typer.Option("--target-tokens", metavar="N", help=(
        "Length in tokens of the calibration prompts (the paper keeps 750-1250)."))] = 1000,
    tokens: int = typer.Option(500, "--tokens", metavar="N", help="Random positions per prompt (the paper's 500)."),
    holdout: int = typer.Option(4, "--holdout", metavar="N", help="Every N-th prompt is held out to measure the fit."),
    epochs: int = typer.Option(15, "--epochs", metavar="N", help="The MLP's training epochs."),
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """KVzap's surrogates: OUT/kvzap-KIND.safetensors (+ .json), read as kvzap:weights=FILE.

    Each calibration prompt is prefilled once, recording every layer's attention input; our KVzip scorer's
    reconstruction pass scores its entries, and --tokens random positions become (hidden state -> log KVzip
    score per KV head) pairs. One prompt in every --holdout is held out: its rank correlation with KVzip is
    printed and stored in the provenance."""
    from rich.console import Console

    from ripplekv.pipeline.kvzap_fit import FitSettings, fit_surrogates
    from ripplekv.pipeline.model_choice import ModelChoice

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    console = Console(stderr=True)
    start = time.perf_counter()
    kinds = [k.strip() for k in models.split(",") if k.strip()]
    written = fit_surrogates(Path(out), ModelChoice(model, device, dtype), FitSettings(tokens, holdout, epochs),
                             chosen, kinds, bar=_bar, announce=lambda: _say_out(console, "fit kvzap", out, True))
    for kind, (path, fit) in written.items():
        console.print(f"{path} ({kind}): held-out rank correlation with KVzip {fit['spearman_mean']:.3f} (per layer "
                      f"{min(fit['spearman_per_layer']):.3f}-{max(fit['spearman_per_layer']):.3f}), "
                      f"R^2 {fit['r2_mean']:.3f}", soft_wrap=True)
    console.print(f"fit kvzap: done in {time.perf_counter() - start:.1f} s")
    _say_written(console, [p for path, _ in written.values() for p in (path, path.with_suffix(".json"))])


@fit_app.command("qfilter")
def fit_qfilter(
    out: FitDir,
    model: Model = None,
    calib_samples: CalibSamples = 16,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    target_tokens: Annotated[int, typer.Option("--target-tokens", metavar="N", help=(
        "Length in tokens of the calibration prompts (the authors' script reads 2048-token sequences)."))] = 2000,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """Q-Filters' filters: OUT/qfilter.safetensors (+ .json), read as qfilter:weights=FILE.

    Each calibration prompt is prefilled once, summing per layer and query head its post-RoPE queries and their
    Gram matrix; each (layer, KV head)'s filter is then the principal right singular vector of its query heads'
    queries over every prompt, signed so the queries project positively on average, averaged over the group."""
    from rich.console import Console

    from ripplekv.pipeline.model_choice import ModelChoice
    from ripplekv.pipeline.qfilter_fit import fit_filters

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    console = Console(stderr=True)
    start = time.perf_counter()
    path, provenance = fit_filters(Path(out), ModelChoice(model, device, dtype), chosen, bar=_bar,
                                   announce=lambda: _say_out(console, "fit qfilter", out, True))
    share = provenance["first_direction_share_per_layer"]
    console.print(f"{path}: {provenance['layers']} layers x {provenance['kv_heads']} KV heads from "
                  f"{provenance['positions']} query positions; the direction holds {min(share):.3f}-{max(share):.3f} "
                  "of the queries' energy per layer", soft_wrap=True)
    console.print(f"fit qfilter: done in {time.perf_counter() - start:.1f} s")
    _say_written(console, [path, path.with_suffix(".json")])


@fit_app.command("fastkvzip")
def fit_fastkvzip(
    out: FitDir,
    model: Model = None,
    calib_samples: CalibSamples = 16,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    target_tokens: Annotated[int, typer.Option("--target-tokens", metavar="N", help=(
        "Length in tokens of the calibration prompts."))] = 1000,
    tokens: int = typer.Option(500, "--tokens", metavar="N", help="Random positions per prompt."),
    holdout: int = typer.Option(4, "--holdout", metavar="N", help="Every N-th prompt is held out to measure the fit."),
    steps: int = typer.Option(5000, "--steps", metavar="N", help="SGD steps per layer (the authors' 5000)."),
    batch: int = typer.Option(1000, "--batch", metavar="N", help="Entries per step (the authors' 1000)."),
    lr: float = typer.Option(0.2, "--lr", metavar="X", help="SGD learning rate (the authors' 0.2)."),
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """FastKVzip's gates: OUT/fastkvzip.safetensors (+ .json), read as fastkvzip:weights=FILE.

    The pairs are KVzap's (hidden state -> KVzip score per KV head at --tokens random positions of each
    calibration prompt, resumable); each layer's gate is fitted on them by the authors' binary cross-entropy.
    One prompt in every --holdout is held out: its rank correlation with KVzip is printed and stored."""
    from rich.console import Console

    from ripplekv.pipeline.fastkvzip_fit import GateSettings, fit_gates
    from ripplekv.pipeline.model_choice import ModelChoice

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    console = Console(stderr=True)
    start = time.perf_counter()
    path, fit = fit_gates(Path(out), ModelChoice(model, device, dtype), GateSettings(tokens, holdout, 0, steps, batch, lr),
                          chosen, bar=_bar, announce=lambda: _say_out(console, "fit fastkvzip", out, True),
                          layer_bar=lambda total, done: _progress_bar("layers fitted", total, done))
    console.print(f"{path}: held-out rank correlation with KVzip {fit['spearman_mean']:.3f} (per layer "
                  f"{min(fit['spearman_per_layer']):.3f}-{max(fit['spearman_per_layer']):.3f}), R^2 {fit['r2_mean']:.3f}",
                  soft_wrap=True)
    console.print(f"fit fastkvzip: done in {time.perf_counter() - start:.1f} s")
    _say_written(console, [path, path.with_suffix(".json")])


@fit_app.command("compresskv")
def fit_compresskv(
    out: Annotated[str, typer.Option("--out", metavar="CSV", help="The layer,error CSV to write.")],
    model: Model = None,
    calib_samples: CalibSamples = 6,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    budget: LayerBudget = 128,
    window: int = typer.Option(32, "--window", metavar="N", help="Window queries standing in for decoding steps."),
    target_tokens: TargetTokens = TARGET_TOKENS,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """CompressKV's layer profile: the layer,error CSV read as compresskv:profile=FILE.

    A layer's error is the relative error of its window queries' attention output when its cache keeps only
    SnapKV's selection at --budget, averaged over the calibration prompts (one prefill each)."""
    from rich.console import Console

    from ripplekv.pipeline import compresskv_fit
    from ripplekv.pipeline.model_choice import ModelChoice

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    settings = compresskv_fit.LayerErrorSettings(budget, window)
    where = ModelChoice(model, device, dtype)
    console = Console(stderr=True)
    compresskv_fit.check_compresskv_fit(out, where, settings, chosen)
    _say_out(console, "fit compresskv", out, True)
    start = time.perf_counter()
    path, errors, count = compresskv_fit.fit_compresskv(out, where, settings, chosen, bar=_bar)
    console.print(f"{len(errors)} layers from {count} calibration prompts in {time.perf_counter() - start:.1f} s; "
                  f"errors {min(errors):.4f} to {max(errors):.4f}")
    _say_written(console, [path, path.with_suffix(".json")])


@fit_app.command("duoattention")
def fit_duoattention(
    out: FitDir,
    model: Model = None,
    steps: int = typer.Option(40, "--steps", metavar="N", help="Optimisation steps, one calibration prompt each."),
    sinks: int = typer.Option(16, "--sinks", metavar="N", help="A streaming head's attention sinks."),
    recent: int = typer.Option(64, "--recent", metavar="N", help="A streaming head's recent window."),
    l1: float = typer.Option(0.05, "--l1", metavar="W", help="The L1 penalty's weight on the gates (the paper's 0.05)."),
    lr: float = typer.Option(0.02, "--lr", metavar="R", help="AdamW's learning rate (the paper's 0.02)."),
    calib_samples: CalibSamples = 8,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: Annotated[str | None, typer.Option("--calib-tasks", metavar="TASKS", help=(
        "Synthetic needle tasks to distil on (default: niah,niah_multikey; SUITE:TASK for RULER's)."))] = None,
    target_tokens: Annotated[int, typer.Option("--target-tokens", metavar="N", help=(
        "Length in tokens of the calibration prompts (short: the fit backpropagates through the model)."))] = 600,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """DuoAttention's gates: OUT/duoattention-gates.json, read as duoattention:gates=FILE.

    Each step mixes every KV head's attention as gate x full + (1 - gate) x streaming (sinks + recent window) and
    moves the gates so the last hidden states on a needle prompt's appended answer match the full model's, plus
    an L1 penalty; the model stays frozen. Every step is checkpointed: rerun the same command to resume."""
    from rich.console import Console

    from ripplekv.pipeline.duoattention_fit import DEFAULT_TASKS, GateSettings, fit_gates
    from ripplekv.pipeline.model_choice import ModelChoice

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, with_answer=True,
                         tasks=calib_tasks if calib_tasks is not None else ",".join(DEFAULT_TASKS))
    console = Console(stderr=True)
    start = time.perf_counter()
    path, info = fit_gates(Path(out), ModelChoice(model, device, dtype), GateSettings(steps, sinks, recent, l1, lr),
                           chosen, bar=lambda total, done: _progress_bar("gate steps", total, done),
                           announce=lambda: _say_out(console, "fit duoattention", out, True))
    console.print(f"{path}: {info['steps_done']} steps, final loss {info['final_loss']:.4g} (distillation "
                  f"{info['final_distill']:.4g}), {info['seconds']:.1f} s of steps", soft_wrap=True)
    console.print(f"fit duoattention: done in {time.perf_counter() - start:.1f} s")
    _say_written(console, [path, path.parent / "checkpoint.pt"])
