"""The calibration stages: `profile`, `allocate`, `route` and `tune`.

`profile` measures each layer's sensitivity, `allocate` turns a profile into per-layer budget multipliers,
`route` picks a method per layer and `tune` chooses a baseline's knobs (CAKE's temperatures, PyramidKV's beta) on
calibration prompts; each checks its options, then hands the work to ripplekv.pipeline.
They are grouped because they are the steps that prepare what `eval` later reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from ripplekv.cli.options import (
    DEFAULT_ALLOCATION,
    DEFAULT_PROBE_TOKENS,
    DEFAULT_PROFILE,
    DEFAULT_ROUTE,
    TARGET_TOKENS,
    CalibDraw,
    CalibDraws,
    CalibSamples,
    CalibTasks,
    Device,
    Dtype,
    Model,
    ProbeTokens,
    RayAddress,
    TargetTokens,
    WithAnswer,
    Workers,
    _progress_bar,
    _say_out,
    _say_written,
    budget_option,
    calibration,
    check_extensions,
    flag,
    model_shape,
    out_option,
    seed_option,
    worker_settings,
)
from ripplekv.defaults import (
    DEFAULT_ROUTE_CANDIDATES,
    EVICTION_METHOD,
    MAPS,
    MEASURES,
    PROFILE_ETA,
    PROFILE_SEEDS,
    PRUNE_RATIO,
    SIGNALS,
)
from ripplekv.errors import UserError

ProfileOut = out_option("Directory for sensitivity.csv, per_sample.csv, profile.json, sensitivity.png", DEFAULT_PROFILE)
AllocationOut = out_option("Allocation CSV to write (layer,sensitivity,multiplier)", DEFAULT_ALLOCATION, "CSV")
RouteOut = out_option("Directory for ROUTE.csv, preferences.csv, placements.csv, route.json and plots", DEFAULT_ROUTE)
Signal = Annotated[Literal[SIGNALS], typer.Option(
    "--signal", help="noise (RippleKV), evict (DepthKV: prune one layer with --evict-method) or infonce "
                     "(InfoNCE of each layer's pooled representations of two views of each prompt).")]
Measure = Annotated[Literal[MEASURES], typer.Option(
    "--measure", help="With --signal evict: task-drop (DepthKV as published: the drop in the task metric of the "
                      "greedy answer) or kl (KL at the probe tokens).")]
Mapping = Annotated[Literal[MAPS], typer.Option(
    "--map", help="exponential (RippleKV: ratio-bounded) or proportional (DepthKV: budgets proportional to sensitivity).")]
RouteSeed = seed_option("the random placements")
CalibrationBudget = budget_option("Calibration compares the ratios at this budget.")
TuneBudget = budget_option("Calibration compares the grid's points at this budget.")
MaxExtensions = Annotated[int, typer.Option(
    "--max-extensions", metavar="N", help="When calibration picks a value at an edge of the grid, add one beyond it "
    "(doubling, or halving), at most N times per knob; the output notes a pick left at an edge.")]
RouteBudget = budget_option("Each layer is compressed to it in turn.")


def profile(
    out: ProfileOut = None,
    model: Model = None,
    calib_samples: CalibSamples = 4,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    seeds: int = typer.Option(PROFILE_SEEDS, "--seeds", metavar="N", help="Noise draws per sample; make reproduce uses 2."),
    eta: float = typer.Option(PROFILE_ETA, "--eta", help="Noise scale relative to each value vector RMS (KL grows as eta^2 up to ~1)."),
    signal: Signal = "noise",
    evict_budget: int | None = typer.Option(None, "--evict-budget", metavar="B",
                                            help="With --signal evict --measure kl: the budget a layer is evicted to "
                                                 "(default 128; the global ratio: the evaluation budget)."),
    evict_method: str | None = typer.Option(None, "--evict-method", metavar="SPEC",
                                            help=f"Method whose selection evicts the layer with --signal evict (default "
                                                 f"{EVICTION_METHOD}, DepthKV's); uniform budgets, so every layer is "
                                                 "pruned alike."),
    measure: Measure = None,
    prune_ratio: float | None = typer.Option(
        None, "--prune-ratio", metavar="R", help=f"With --signal evict: prune this share of a layer's prompt entries "
        f"(default {PRUNE_RATIO} with --measure task-drop, DepthKV's headline; with kl, --evict-budget unless given)."),
    probe_tokens: ProbeTokens = DEFAULT_PROBE_TOKENS,
    with_answer: WithAnswer = False,
    target_tokens: TargetTokens = TARGET_TOKENS,
    batch_size: int = typer.Option(32, "--batch-size", metavar="N", help="Perturbed layers run together in one batch."),
    device: Device = "auto",
    dtype: Dtype = "auto",
    workers: Workers = 1,
    ray_address: RayAddress = None,
) -> None:
    """Measure each layer's sensitivity: perturb or prune its cache, KL or task-score drop at the output.

    Rerunning the same command resumes an interrupted profile (finished samples are kept)."""
    from rich.console import Console

    from ripplekv.methods.core.budgets import check_budget
    from ripplekv.pipeline.model_choice import ModelChoice
    from ripplekv.pipeline.profile import ProfileSettings, check_given, profile_into

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, with_answer, calib_tasks)
    check_given(signal, measure or "task-drop", {"--evict-method": evict_method, "--evict-budget": evict_budget,
                                                 "--measure": measure, "--prune-ratio": prune_ratio})
    settings = ProfileSettings(eta, seeds, signal, probe_tokens, check_budget(128 if evict_budget is None else evict_budget),
                               batch_size, evict_method or EVICTION_METHOD, measure or "task-drop", prune_ratio)
    if signal == "evict" and settings.measure == "task-drop" and with_answer:
        raise UserError("--with-answer feeds the answer as probe tokens (a KL measure); the task-drop measure "
                        "scores the model's own answer: drop --with-answer or pass --measure kl")
    scale = worker_settings(workers, ray_address)
    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_PROFILE
    count, meta = profile_into(out_dir, ModelChoice(model, device, dtype).resolved(), settings, chosen, workers=scale,
                               bar=lambda total, done: _progress_bar("profiling", total, done),
                               announce=lambda: _say_out(console, "profile", out_dir, out is not None))
    rho = meta["split_half_spearman"]
    console.print(
        f"profiled {count} samples x {meta['num_layers']} layers; split-half Spearman rho = "
        + (f"{rho:.3f}" if rho is not None else "n/a (one sample)")
    )
    _say_written(console, [out_dir / name for name in ("sensitivity.csv", "per_sample.csv", "profile.json", "sensitivity.png")])


# allocate's options that only steer the calibration choosing among several --ratio values
SWEEP_OPTIONS = ("budget", "calib_samples", "calib_draw", "calib_draws", "max_extensions", "device", "dtype")


def allocate(
    ctx: typer.Context,
    sensitivity: str | None = typer.Argument(
        None, help=f"sensitivity.csv from `ripplekv profile`; default: {DEFAULT_PROFILE}/sensitivity.csv."),
    out: AllocationOut = None,
    ratio: list[float] | None = typer.Option(
        None, "--ratio", help="Max/min budget multiplier (exponential map; default 4); repeat to let calibration choose."
    ),
    mapping: Mapping = "exponential",
    floor: float | None = typer.Option(
        None, "--floor", help="--map proportional: the least multiplier a layer gets (e.g. 0.25: at least B/4); off by default."
    ),
    cap: float | None = typer.Option(
        None, "--cap", help="--map proportional: the most multiplier a layer gets (e.g. 4: at most 4B); off by default."
    ),
    model: Model = None,
    budget: CalibrationBudget = 128,
    calib_samples: CalibSamples = 7,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    max_extensions: MaxExtensions = 3,
    target_tokens: TargetTokens = TARGET_TOKENS,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """Turn a sensitivity profile into per-layer budget multipliers (and pick the ratio by calibration)."""
    from rich.console import Console

    from ripplekv.pipeline.allocate import AllocateSettings, check_bounds, run_allocate
    from ripplekv.pipeline.model_choice import ModelChoice

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    check_extensions(max_extensions)
    if mapping == "proportional" and ratio:
        raise UserError("--ratio applies to --map exponential only; --map proportional takes no ratio")
    check_bounds(floor, cap)
    if mapping != "proportional" and (floor is not None or cap is not None):
        raise UserError("--floor and --cap apply to --map proportional only; the exponential map is bounded by --ratio")
    idle = [name for name in SWEEP_OPTIONS if ctx.get_parameter_source(name).name != "DEFAULT"]
    if idle and (mapping == "proportional" or len(set(ratio or [])) < 2):
        without = "--map proportional takes no ratio" if mapping == "proportional" else "one --ratio is taken as it is"
        raise UserError(f"{', '.join(flag(name) for name in idle)} steer the calibration that chooses among several "
                        f"--ratio values; {without}, so nothing is calibrated: drop them, or repeat --ratio "
                        "(e.g. --ratio 2 --ratio 4)")
    console = Console(stderr=True)
    out_path = Path(out) if out else DEFAULT_ALLOCATION
    if sensitivity is None:
        sensitivity = str(DEFAULT_PROFILE / "sensitivity.csv")
        if not Path(sensitivity).is_file():
            raise UserError(f"no profile at {sensitivity}: run `ripplekv profile` first, or pass a sensitivity.csv")

    def announce() -> None:
        _say_out(console, "allocate", out_path, out is not None)
        console.print(f"allocate: read {sensitivity}", soft_wrap=True)

    settings = AllocateSettings(tuple(ratio or [4.0]), mapping, floor, cap, budget, max_extensions)
    written = run_allocate(sensitivity, out_path, settings, ModelChoice(model, device, dtype), chosen, console,
                           bar=lambda total, done: _progress_bar("choosing ratio", total, done), announce=announce)
    _say_written(console, written)


def route_command(
    out: RouteOut = None,
    model: Model = None,
    methods: str = typer.Option(",".join(DEFAULT_ROUTE_CANDIDATES), "--methods", metavar="SPECS",
                                help="Candidate methods (only their scorers are used), comma-separated specs."),
    budget: RouteBudget = 128,
    calib_samples: CalibSamples = 8,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    placements: int = typer.Option(100, "--placements", metavar="N",
                                   help="Random placements (same method counts) to rank the route among; 0 skips."),
    placement_samples: int = typer.Option(8, "--placement-samples", metavar="N",
                                          help="Further calibration prompts (held out from the preferences) that score "
                                               "placements; each placement is compared with the route by a paired "
                                               "bootstrap over them (at least 2 for an interval)."),
    max_share: list[str] = typer.Option([], "--max-share", help="Cap a method's share of layers: snapkv=0.5 (or 0.5 for all); repeatable."),
    probe_tokens: ProbeTokens = DEFAULT_PROBE_TOKENS,
    with_answer: WithAnswer = False,
    target_tokens: TargetTokens = TARGET_TOKENS,
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", metavar="N", help="Length of the full cache's answer placements are scored on."),
    batch_size: int = typer.Option(32, "--batch-size", metavar="N", help="(layer, method) trials or placements run together."),
    seed: RouteSeed = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """Route a method to each layer by per-(layer, method) KL, and rank the route among random placements."""
    from rich.console import Console

    from ripplekv.pipeline.eval_plan import parse_names
    from ripplekv.pipeline.model_choice import ModelChoice
    from ripplekv.pipeline.route import (
        RouteSettings,
        candidate_methods,
        check_placement_study,
        check_route_dir,
        check_route_window,
        parse_caps,
    )
    from ripplekv.runs.safeio import exclusive

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, with_answer, calib_tasks)
    listed = [part.strip() for part in methods.split(",") if part.strip()]
    if len(set(listed)) < len(listed):
        raise UserError(f"--methods lists a candidate twice ({methods}); name each candidate once")
    settings = RouteSettings(parse_names(methods), budget, probe_tokens, batch_size, tuple(max_share), placements,
                             max_new_tokens, seed)
    settings.check()
    labels = [m.label for m in candidate_methods(settings.methods)]
    parse_caps(settings.max_share, labels, model_shape(model)[0])  # bad caps fail before the model loads
    if placement_samples < 0:
        raise UserError("--calib-samples must be at least 1 and --placement-samples at least 0")
    check_placement_study(len(labels), placements, placement_samples)
    out_dir = check_route_dir(Path(out) if out else DEFAULT_ROUTE, model)
    console = Console(stderr=True)
    where = ModelChoice(model, device, dtype).resolved()
    if out is None:  # said once the options are known to be good, so a mistake is still one line
        _say_out(console, "route", out_dir, False)
    held_out = placement_samples if placements else 0
    check_route_window(model, settings, chosen, held_out)
    with exclusive(out_dir, "route"):
        _route_locked(out_dir, where, settings, chosen, held_out, console)


def _route_locked(out, model, settings, calibration, placement_samples, console) -> None:
    from ripplekv.pipeline.route import route_into

    meta, layers, scored = route_into(out, model, settings, calibration, placement_samples,
                                      progress_bar=lambda total: _progress_bar("routing", total))
    budget, placements = settings.budget, settings.placements
    counts = ", ".join(f"{label} x{count}" for label, count in meta["method_counts"].items())
    rank = meta["placement_rank"]
    console.print(f"route over {layers} layers: {counts}; wrote {out}/ROUTE.csv")
    if meta.get("split_half"):
        from ripplekv.analysis.agreement import agreement_text

        half = meta["split_half"]
        console.print(f"split-half stability: the routes of the even and odd calibration prompts "
                      f"({half['samples'][0]} and {half['samples'][1]}) agree on {agreement_text(half)}")
    if meta.get("placement_summary"):
        console.print(f"placement study (teacher-forced KL on {scored} held-out calibration prompts, B={budget}): "
                      f"{meta['placement_summary']}")
    elif rank is not None:
        console.print(f"placement study: route ranks {rank} of {meta['placements_scored'] + 1} "
                      f"(teacher-forced KL on {scored} held-out calibration prompt, B={budget}; no interval from one)")
    elif placements:
        console.print(f"note: the route uses {meta['route'][0]} in every layer, so every placement is the route itself; "
                      "no placement study", soft_wrap=True)


def tune(
    grids: list[str] = typer.Argument(
        ..., metavar="GRID...", help="A method spec whose options list values to choose among, e.g. "
        "cake:tau1=0.5,1,2:tau2=0.5,1,2 or pyramidkv:beta=5,10,20,40 (an option with one value is fixed)."),
    out: str = typer.Option(..., "--out", metavar="JSON", help="Tune result to write (JSON; every point's KL beside it "
                                                                "as .csv)."),
    model: Model = None,
    budget: TuneBudget = 128,
    calib_samples: CalibSamples = 7,
    calib_draw: CalibDraw = 0,
    calib_draws: CalibDraws = 1,
    calib_tasks: CalibTasks = None,
    max_extensions: MaxExtensions = 3,
    target_tokens: TargetTokens = TARGET_TOKENS,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """Choose baselines' knobs on calibration prompts (teacher-forced KL to the full cache), as allocate chooses the ratio."""
    from rich.console import Console

    from ripplekv.pipeline.model_choice import ModelChoice
    from ripplekv.pipeline.tune import GridSettings, parse_grid, run_tune

    chosen = calibration(calib_samples, calib_draw, calib_draws, target_tokens, tasks=calib_tasks)
    check_extensions(max_extensions)
    parsed = [parse_grid(text) for text in grids]
    console = Console(stderr=True)
    written = run_tune(parsed, Path(out), ModelChoice(model, device, dtype), chosen,
                       GridSettings(budget, max_extensions), console,
                       bar=lambda total, done: _progress_bar("tuning", total, done),
                       announce=lambda: _say_out(console, "tune", Path(out), True))
    _say_written(console, written)
