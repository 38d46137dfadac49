"""The calibration stages: `profile`, `allocate` and `route`.

`profile` measures each layer's sensitivity, `allocate` turns a profile into per-layer budget multipliers
and `route` picks a method per layer; each checks its options, then hands the work to ripplekv.pipeline.
They are grouped because they are the steps that prepare what `eval` later reads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ripplekv.cli.options import (
    DEFAULT_ALLOCATION,
    DEFAULT_PROFILE,
    DEVICE_HELP,
    DTYPE_HELP,
    RAY_ADDRESS_HELP,
    WORKERS_HELP,
    _progress_bar,
    _say_out,
    _say_written,
    model_shape,
    worker_settings,
)
from ripplekv.errors import UserError


def profile(
    out: str | None = typer.Option(None, help=f"Directory for sensitivity.csv, per_sample.csv, profile.json, "
                                   f"sensitivity.png; default: {DEFAULT_PROFILE}."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    calib_samples: int = typer.Option(
        4, "--calib-samples", help="Calibration prompts (offline suite's calibration split); make reproduce uses 12."),
    seeds: int = typer.Option(1, help="Noise draws per sample; make reproduce uses 2."),
    eta: float = typer.Option(0.3, help="Noise scale relative to each value vector RMS (KL grows as eta^2 up to ~1)."),
    signal: str = typer.Option("noise", help="noise (RippleKV) or evict (DepthKV: evict one layer with --evict-method)."),
    evict_budget: int = typer.Option(128, "--evict-budget", help="Budget a layer is evicted to with --signal evict (the global ratio: the evaluation budget)."),
    evict_method: str = typer.Option("h2o", "--evict-method", help="Method whose selection evicts the layer with --signal evict (DepthKV: h2o)."),
    probe_tokens: int = typer.Option(16, "--probe-tokens", help="Final prompt tokens used as probes (the question)."),
    with_answer: bool = typer.Option(False, "--with-answer", help="Also teacher-force the reference answer as probes."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    batch_size: int = typer.Option(32, "--batch-size", help="Perturbed layers run together in one batch."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    workers: int = typer.Option(1, "--workers", help=WORKERS_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Measure each layer's sensitivity: perturb its value cache, KL at the output.

    Rerunning the same command resumes an interrupted profile (finished samples are kept)."""
    from rich.console import Console

    from ripplekv.engine.models import resolve_device_dtype
    from ripplekv.methods.budgets import check_budget
    from ripplekv.pipeline.profile import ProfileSettings, profile_into

    settings = ProfileSettings(eta, seeds, signal, probe_tokens, check_budget(evict_budget), batch_size, evict_method)
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    scale = worker_settings(workers, ray_address)
    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_PROFILE
    device, dtype = resolve_device_dtype(device, dtype)
    count, meta = profile_into(out_dir, model, settings, calib_samples=calib_samples, target_tokens=target_tokens,
                               with_answer=with_answer, device=device, dtype=dtype, workers=scale,
                               bar=lambda total, done: _progress_bar("profiling", total, done),
                               announce=lambda: _say_out(console, "profile", out_dir, out is not None))
    rho = meta["split_half_spearman"]
    console.print(
        f"profiled {count} samples x {meta['num_layers']} layers; split-half Spearman rho = "
        + (f"{rho:.3f}" if rho is not None else "n/a (one sample)")
    )
    _say_written(console, [out_dir / name for name in ("sensitivity.csv", "per_sample.csv", "profile.json", "sensitivity.png")])


def allocate(
    sensitivity: str | None = typer.Argument(
        None, help=f"sensitivity.csv from `ripplekv profile`; default: {DEFAULT_PROFILE}/sensitivity.csv."),
    out: str | None = typer.Option(
        None, help=f"Allocation CSV to write (layer,sensitivity,multiplier); default: {DEFAULT_ALLOCATION}."),
    ratio: list[float] | None = typer.Option(
        None, help="Max/min budget multiplier (exponential map; default 4); repeat to let calibration choose."
    ),
    mapping: str = typer.Option(
        "exponential", "--map", help="exponential (RippleKV: ratio-bounded) or proportional (DepthKV: budgets proportional to sensitivity)."
    ),
    floor: float | None = typer.Option(
        None, "--floor", help="--map proportional: the least multiplier a layer gets (e.g. 0.25: at least B/4); off by default."
    ),
    cap: float | None = typer.Option(
        None, "--cap", help="--map proportional: the most multiplier a layer gets (e.g. 4: at most 4B); off by default."
    ),
    model: str | None = typer.Option(None, help="Model the profile belongs to; default: bundled SmolLM2."),
    budget: int = typer.Option(128, help="Budget at which calibration compares ratios."),
    calib_samples: int = typer.Option(7, "--calib-samples", help="Calibration prompts for choosing among ratios."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Turn a sensitivity profile into per-layer budget multipliers (and pick the ratio by calibration)."""
    from rich.console import Console

    from ripplekv.methods.budgets import check_budget
    from ripplekv.pipeline.allocate import check_bounds, check_map, run_allocate

    check_map(mapping)
    if mapping == "proportional" and ratio:
        raise UserError("--ratio applies to --map exponential only; --map proportional takes no ratio")
    check_bounds(floor, cap)
    if mapping != "proportional" and (floor is not None or cap is not None):
        raise UserError("--floor and --cap apply to --map proportional only; the exponential map is bounded by --ratio")
    check_budget(budget)
    if calib_samples < 1:
        raise UserError(f"--calib-samples must be at least 1, got {calib_samples}")
    console = Console(stderr=True)
    out_path = Path(out) if out else DEFAULT_ALLOCATION
    if sensitivity is None:
        sensitivity = str(DEFAULT_PROFILE / "sensitivity.csv")
        if not Path(sensitivity).is_file():
            raise UserError(f"no profile at {sensitivity}: run `ripplekv profile` first, or pass a sensitivity.csv")

    def announce() -> None:
        _say_out(console, "allocate", out_path, out is not None)
        console.print(f"allocate: read {sensitivity}", soft_wrap=True)

    written = run_allocate(sensitivity, out_path, ratio or [4.0], model, budget, calib_samples, target_tokens, console,
                           bar=lambda total, done: _progress_bar("choosing ratio", total, done), device=device, dtype=dtype,
                           mapping=mapping, announce=announce, floor=floor, cap=cap)
    _say_written(console, written)


def route_command(
    out: str = typer.Option(..., help="Directory for ROUTE.csv, preferences.csv, placements.csv, route.json and plots."),
    model: str | None = typer.Option(None, help="Model (hub id, directory, .gguf); default: bundled SmolLM2."),
    methods: str = typer.Option("snapkv,streamingllm,h2o,tova,knorm", "--methods",
                                help="Candidate methods (only their scorers are used), comma-separated specs."),
    budget: int = typer.Option(128, help="Budget B a layer is compressed to (entries per KV head)."),
    calib_samples: int = typer.Option(8, "--calib-samples", help="Calibration prompts for the preferences."),
    placements: int = typer.Option(100, help="Random placements (same method counts) to rank the route among; 0 skips."),
    placement_samples: int = typer.Option(4, "--placement-samples",
                                          help="Further calibration prompts (held out from the preferences) that score placements."),
    max_share: list[str] = typer.Option([], "--max-share", help="Cap a method's share of layers: snapkv=0.5 (or 0.5 for all); repeatable."),
    probe_tokens: int = typer.Option(16, "--probe-tokens", help="Final prompt tokens used as probes (as in profile)."),
    with_answer: bool = typer.Option(False, "--with-answer", help="Also teacher-force the reference answer as probes."),
    target_tokens: int = typer.Option(3500, "--target-tokens", help="Calibration prompt length in tokens."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Length of the full cache's answer placements are scored on."),
    batch_size: int = typer.Option(32, "--batch-size", help="(layer, method) trials or placements run together."),
    seed: int = typer.Option(0, help="Seed of the random placements."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Route a method to each layer by per-(layer, method) KL, and rank the route among random placements."""
    from rich.console import Console

    from ripplekv.engine.models import resolve_device_dtype
    from ripplekv.pipeline.eval_plan import parse_names
    from ripplekv.pipeline.route import RouteSettings, candidate_methods, check_route_dir, parse_caps
    from ripplekv.runs.safeio import exclusive

    listed = [part.strip() for part in methods.split(",") if part.strip()]
    if len(set(listed)) < len(listed):
        raise UserError(f"--methods lists a candidate twice ({methods}); name each candidate once")
    settings = RouteSettings(parse_names(methods), budget, probe_tokens, batch_size, tuple(max_share), placements,
                             max_new_tokens, seed)
    settings.check()
    labels = [m.label for m in candidate_methods(settings.methods)]
    parse_caps(settings.max_share, labels, model_shape(model)[0])  # bad caps fail before the model loads
    if calib_samples < 1 or placement_samples < 0:
        raise UserError("--calib-samples must be at least 1 and --placement-samples at least 0")
    out_dir = check_route_dir(Path(out), model)
    console = Console(stderr=True)
    device, dtype = resolve_device_dtype(device, dtype)
    with exclusive(out_dir, "route"):
        _route_locked(out_dir, model, settings, calib_samples, placement_samples, placements, probe_tokens,
                      target_tokens, with_answer, budget, device, dtype, console)


def _route_locked(out, model, settings, calib_samples, placement_samples, placements, probe_tokens, target_tokens,
                  with_answer, budget, device, dtype, console) -> None:
    from ripplekv.pipeline.route import route_into

    meta, layers, scored = route_into(out, model, settings, calib_samples=calib_samples,
                                      placement_samples=placement_samples if placements else 0,
                                      target_tokens=target_tokens, with_answer=with_answer, device=device, dtype=dtype,
                                      progress_bar=lambda total: _progress_bar("routing", total))
    counts = ", ".join(f"{label} x{count}" for label, count in meta["method_counts"].items())
    rank = meta["placement_rank"]
    console.print(f"route over {layers} layers: {counts}; wrote {out}/ROUTE.csv")
    if rank is not None:
        console.print(f"placement study: route ranks {rank} of {meta['placements_scored'] + 1} "
                      f"(teacher-forced KL on {scored} held-out calibration prompts, B={budget})")
