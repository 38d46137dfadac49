"""From a sensitivity profile to per-layer budget multipliers.

Two maps (`ripplekv allocate --map`):
- `exponential` (RippleKV, the default): s_hat = (s - min) / (max - min); m = exp(ln(R) * s_hat), so the
  most sensitive layer gets R times the least sensitive one; then m / mean(m), so the average is 1 and
  the total budget is unchanged. R = 1 is uniform. With several ratios, the calibration split picks the
  one whose compressed cache stays closest to the full cache (teacher-forced KL along the full cache's
  own answers).
- `proportional` (DepthKV): m = s / mean(s), budgets proportional to sensitivity (a layer whose
  sensitivity is 0 keeps only its scorer's floor); no ratio. `--floor F` / `--cap C` (ours; off by
  default, so the multipliers are exactly s / mean(s)) bound the multipliers to [F, C] with their mean
  kept at 1: m = clip(t s / mean(s), F, C) with the one t that makes mean(m) = 1, so the least sensitive
  layer keeps at least F x B and the most sensitive at most C x B, and the total stays L x B.
The map is recorded in the allocation CSV's `map` column (`proportional:floor=0.25:cap=4` when bounded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.defaults import MAPS
from ripplekv.errors import UserError
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import UnitLog, check_output, save_figure, write_csv, write_json
from ripplekv.tasks.calibration import Calibration


def read_profile_sensitivity(path: str | Path, num_layers: int | None = None) -> np.ndarray:
    """Sensitivity by layer from sensitivity.csv, checked against the model's layer count: its `sensitivity`
    column when it has one (a task-drop or InfoNCE profile), else `kl_mean` (a KL profile)."""
    from ripplekv.methods.core.tables import read_numbers

    column = "sensitivity" if "sensitivity" in _header(path) else "kl_mean"
    values = np.asarray(read_numbers(path, column, "sensitivity", "run `ripplekv profile --out DIR` first"))
    if (values < 0).any():
        raise UserError(f"sensitivity file {path} has negative {column} values; a sensitivity is never negative")
    if num_layers is not None and len(values) != num_layers:
        raise UserError(
            f"sensitivity file {path} has {len(values)} layers but the model has {num_layers}; "
            "profile the same model you allocate for"
        )
    return values


def _header(path: str | Path) -> list[str]:
    """The column names of a CSV's first line ([] when it cannot be read: the strict reader then says why)."""
    try:
        with Path(path).open(encoding="utf-8-sig") as handle:
            return [cell.strip() for cell in handle.readline().split(",")]
    except (OSError, UnicodeDecodeError):
        return []


def check_ratio(ratio: float) -> float:
    if not math.isfinite(ratio) or ratio < 1:
        raise UserError(f"--ratio must be a number >= 1 (max/min budget multiplier), got {ratio}")
    return float(ratio)


def multipliers(sensitivity, ratio: float) -> np.ndarray:
    """Exponential map of min-max normalized sensitivity; max/min = ratio, mean = 1."""
    ratio = check_ratio(ratio)
    s = np.asarray(sensitivity, dtype=float)
    spread = s.max() - s.min()
    normalized = (s - s.min()) / spread if spread > 0 else np.zeros_like(s)
    raw = np.exp(math.log(ratio) * normalized)
    return raw / raw.mean()


def check_map(name: str) -> str:
    if name not in MAPS:
        raise UserError(f"--map must be one of {', '.join(MAPS)}, got {name!r}")
    return name


def check_bounds(floor: float | None, cap: float | None) -> tuple[float | None, float | None]:
    """`--floor` in [0, 1] and `--cap` >= 1: multipliers of B, on either side of the mean 1 they must keep."""
    if floor is not None and not (math.isfinite(floor) and 0 <= floor <= 1):
        raise UserError(f"--floor must be a multiplier in [0, 1] (the least a layer keeps, times B), got {floor}")
    if cap is not None and not (math.isfinite(cap) and cap >= 1):
        raise UserError(f"--cap must be a multiplier >= 1 (the most a layer keeps, times B), got {cap}")
    return (None if floor is None else float(floor)), (None if cap is None else float(cap))


def proportional_multipliers(sensitivity, floor: float | None = None, cap: float | None = None) -> np.ndarray:
    """DepthKV's map: multipliers proportional to sensitivity, mean 1 (uniform when all are 0).

    With `floor` and/or `cap`: m = clip(t * s / mean(s), floor, cap) with the t that makes mean(m) = 1.
    Solved exactly: the layers at the cap are the most sensitive ones, those at the floor the least, and
    the rest share what is left in proportion to s (no t is formed, so tiny sensitivities cannot overflow
    it). Without bounds the result is exactly s / mean(s), as before the options existed."""
    floor, cap = check_bounds(floor, cap)
    s = np.asarray(sensitivity, dtype=float)
    base = s / s.mean() if s.sum() > 0 else np.ones_like(s)
    if floor is None and cap is None:
        return base
    lo, hi = floor or 0.0, math.inf if cap is None else cap
    layers = len(base)
    order = np.argsort(-base, kind="stable")
    ranked = base[order]
    tol = 1e-12
    with np.errstate(over="ignore"):  # a share of a tiny sensitivity may overflow to inf: it is then above the cap
        for top in range(layers + 1) if math.isfinite(hi) else [0]:  # layers at the cap
            for bottom in range(layers - top + 1):  # layers at the floor
                rest = layers - (top * hi if top else 0.0) - bottom * lo  # what the free layers share
                free = ranked[top: layers - bottom]
                total = free.sum()
                if top and ranked[top - 1] <= 0:  # only a sensitive layer can reach the cap
                    continue
                if free.size == 0:  # every layer at a bound: one t must put the capped ones above, the rest below
                    shares = np.empty(0)
                    if abs(rest) > tol * layers or (top and bottom and ranked[top] * hi > lo * ranked[top - 1] * (1 + tol)):
                        continue
                elif total <= 0 or rest < 0:
                    continue
                else:
                    shares = rest * (free / total)
                    if shares.min() < lo - tol or shares.max() > hi + tol:
                        continue
                if free.size and top and rest * (ranked[top - 1] / total) < hi - tol:  # a capped layer would be below the cap
                    continue
                if free.size and bottom and rest * (ranked[layers - bottom] / total) > lo + tol:  # a floored one above the floor
                    continue
                result = np.empty(layers)
                result[order] = np.concatenate([np.full(top, hi), shares, np.full(bottom, lo)])
                return result
    raise UserError(f"--cap {cap if cap is not None else math.inf:g} with --floor {lo:g} cannot keep the mean multiplier "
                    f"at 1: {int((base == 0).sum())} of {layers} layers have sensitivity 0; raise --cap or --floor")


def map_label(mapping: str, floor: float | None = None, cap: float | None = None) -> str:
    """The `map` column: the map's name, with its bounds when set (`proportional:floor=0.25:cap=4`)."""
    bounds = [f"{name}={value:g}" for name, value in (("floor", floor), ("cap", cap)) if value is not None]
    return ":".join([mapping, *bounds])


def write_allocation(path: Path, sensitivity, mult, mapping: str = "exponential") -> None:
    table = pd.DataFrame({"layer": np.arange(len(mult)), "sensitivity": sensitivity, "multiplier": mult, "map": mapping})
    write_csv(path, table, float_format="%.10g")


def ratio_sweep(model, prompts, sensitivity, ratios, budget: int, progress=None, log=None) -> pd.DataFrame:
    """Teacher-forced KL(full || ripplekv@R) and agreement on calibration prompts, mean over prompts per ratio.

    Each prompt is prefilled once; the full cache's greedy answer is the reference; all ratios are scored together
    (`tune.calibration_fidelity`). With a `UnitLog`, prompts already in it are skipped, so an interrupted sweep
    resumes.
    """
    from ripplekv.defaults import ALLOCATION_METHOD
    from ripplekv.methods import make_method
    from ripplekv.pipeline.tune import calibration_fidelity

    methods = [make_method(ALLOCATION_METHOD, multipliers=tuple(multipliers(sensitivity, r))) for r in ratios]
    per_sample = calibration_fidelity(model, prompts, methods, budget, progress, log)
    per_sample["ratio"] = [ratios[i] for i in per_sample["index"]]  # every ratio's method has the same label
    return (
        per_sample.groupby("ratio", as_index=False)
        .agg(kl=("kl", "mean"), agreement=("agreement", "mean"), n=("kl", "size"))
        .assign(budget=budget)
    )


def _choose_ratio(model: ModelChoice, values, ratios, settings: AllocateSettings, calibration: Calibration, paths,
                  console, bar, location) -> float:
    """Sweep `ratios` on the draw's calibration prompts, extending the grid while the pick is at its edge; writes
    the sweep and the choice (with any extension or edge note) and returns the chosen ratio."""
    from contextlib import nullcontext

    from ripplekv.pipeline.grid import Axis, grid_search, grid_summary
    from ripplekv.tasks.calibration import calibration_hash

    loaded, tokenizer, _ = model.load()
    prompts = calibration.prompts(tokenizer)
    budget = settings.budget
    rounds: list[int] = []

    def score(points: list[dict]) -> pd.DataFrame:
        """One round: the new ratios on every prompt, logged per prompt in this round's scratch file."""
        new = [point["ratio"] for point in points]
        log_path = paths["log"] if not rounds else paths["log"].with_name(f"{paths['log'].stem}.{len(rounds)}.jsonl")
        rounds.append(len(rounds))
        header = {"model": location, "sensitivity": [float(v) for v in values], "ratios": new, "budget": budget,
                  "calibration_hash": calibration_hash(prompts), "rows": "per method"}
        log = UnitLog(log_path, header, restart=True)  # our scratch file: other settings start it over
        context, advance = bar(len(prompts), len(log.done)) if bar else (nullcontext(), None)
        with context:
            return ratio_sweep(loaded, prompts, values, new, budget, progress=advance, log=log)

    result = grid_search([Axis("ratio", tuple(ratios), low=1.0)], score, settings.max_extensions)
    chosen = result.pick["ratio"]
    sweep = result.table.assign(chosen=result.table["ratio"] == chosen)
    write_csv(paths["sweep"], sweep)
    write_json(paths["choice"], {"ratio": chosen, "candidates": result.axes["ratio"], "initial": ratios,
                                 "extensions": result.extensions["ratio"], "at_edge": result.at_edge,
                                 "notes": result.notes, "budget": budget, **calibration.record(),
                                 "calibration_ids": [p.sample_id for p in prompts]})
    console.print(sweep.to_string(index=False))
    console.print(f"ratio: {grid_summary(result)} (lowest teacher-forced KL at B={budget}); sweep in {paths['sweep']}")
    return chosen


def plot_allocation(path: Path, sensitivity, mult, mapping: str, num_layers: int, prompt_len: int, budget=128) -> None:
    """Multipliers, and the per-layer budgets they give at B=128 beside PyramidKV's, for a prompt of
    `prompt_len` tokens: the command's --target-tokens, the length its eval's prompts are built to (layer
    budgets depend on the prompt length where a layer's share would exceed it).

    `mapping` names the map in the title (e.g. "ratio 4" or "proportional")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ripplekv.defaults import ALLOCATION_METHOD, ALLOCATION_PLOT_BESIDE
    from ripplekv.methods import make_method

    ripple = make_method(ALLOCATION_METHOD, multipliers=tuple(mult)).layer_budgets(num_layers, budget, prompt_len)
    pyramid = make_method(ALLOCATION_PLOT_BESIDE).layer_budgets(num_layers, budget, prompt_len)
    layers = np.arange(num_layers)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.bar(layers, mult, color="tab:blue")
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set_xlabel("layer")
    left.set_ylabel("budget multiplier")
    left.set_title(f"budget multipliers ({mapping})", fontsize=9)
    right.plot(layers, ripple, marker="o", ms=3, label=f"this allocation (sum {sum(ripple)})")
    right.plot(layers, pyramid, marker="s", ms=3, label=f"{ALLOCATION_PLOT_BESIDE} (sum {sum(pyramid)})")
    right.axhline(budget, color="grey", lw=0.8, ls="--", label=f"uniform {budget} (sum {budget * num_layers})")
    right.set_xlabel("layer")
    right.set_ylabel("entries per KV head")
    right.set_title(f"per-layer budgets at B={budget}, prompts of {prompt_len} tokens (--target-tokens)", fontsize=9)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def output_paths(out: Path) -> dict[str, Path]:
    """The files `ripplekv allocate --out ALLOC.csv` writes."""
    return {
        "csv": out, "png": out.with_suffix(".png"),
        "sweep": out.with_name(out.stem + ".sweep.csv"), "choice": out.with_name(out.stem + ".choice.json"),
        "log": out.with_name(f".{out.stem}.sweep.jsonl"),
    }


@dataclass(frozen=True)
class AllocateSettings:
    """How `ripplekv allocate` maps a profile: `mapping` "exponential" with its `ratios` (several: calibration picks
    one at `budget`, extending the grid at most `max_extensions` times per edge) or "proportional" (DepthKV) with
    optional `floor` / `cap` bounds on its multipliers."""

    ratios: tuple[float, ...] = (4.0,)
    mapping: str = "exponential"
    floor: float | None = None
    cap: float | None = None
    budget: int = 128
    max_extensions: int = 3


def run_allocate(sensitivity: str, out: Path, settings: AllocateSettings, model: ModelChoice, calibration: Calibration,
                 console, bar=None, announce=None) -> list[Path]:
    """Check everything, sweep the ratios on `calibration`'s prompts (resumable; a pick at the grid's edge extends
    it, `pipeline.grid`), write the allocation; returns the files written. The proportional map takes no ratio
    and no sweep."""
    from ripplekv.engine.models import load_config, resolve_model

    calibration.check()
    mapping, target_tokens = settings.mapping, calibration.target_tokens
    ratios = sorted({check_ratio(r) for r in settings.ratios})
    source = resolve_model(model.spec)
    inputs = [sensitivity] + ([source.location] if source.kind == "gguf" else [])
    paths = output_paths(Path(out))
    for path in paths.values():
        check_output(path, inputs=inputs)
    num_layers = load_config(model.spec).num_hidden_layers
    values = read_profile_sensitivity(sensitivity, num_layers)
    check_map(mapping)
    floor, cap = check_bounds(settings.floor, settings.cap)
    if mapping != "proportional" and (floor is not None or cap is not None):
        raise UserError("--floor and --cap apply to --map proportional only; the exponential map is bounded by --ratio")
    if mapping == "proportional":
        mult = proportional_multipliers(values, floor, cap)  # bounds that cannot hold fail before anything is said
    elif len(ratios) > 1:  # the sweep's prompts and answers must fit a sliding window: said before the model loads
        from ripplekv.engine.models import load_tokenizer
        from ripplekv.pipeline import tune
        from ripplekv.pipeline.samples import check_calibration_window, model_window

        if model_window(model.spec) is not None:
            tokenizer = load_tokenizer(model.spec)

            def build(target: int):
                return calibration.prompts(tokenizer, target_tokens=target)

            check_calibration_window(model.spec, build(target_tokens), build, target_tokens,
                                     reserve=tune.SWEEP_ANSWER_TOKENS)
    if announce is not None:  # every input checked: bad input stays one line
        announce()
    if mapping == "proportional":
        label = map_label(mapping, floor, cap)
        write_allocation(paths["csv"], values, mult, label)
        plot_allocation(paths["png"], values, mult, label, num_layers, target_tokens)
        console.print(f"{label} map; multipliers {mult.min():.3f}..{mult.max():.3f}")
        return [paths["csv"], paths["png"]]
    chosen = ratios[0]
    if len(ratios) > 1:
        chosen = _choose_ratio(model, values, ratios, settings, calibration, paths, console, bar, source.location)
    mult = multipliers(values, chosen)
    write_allocation(paths["csv"], values, mult, mapping)
    plot_allocation(paths["png"], values, mult, f"exponential, ratio {chosen:g}", num_layers, target_tokens)
    for log in paths["log"].parent.glob(paths["log"].stem + "*.jsonl"):  # every round's scratch log
        log.unlink(missing_ok=True)
    console.print(f"ratio {chosen:g}; multipliers {mult.min():.3f}..{mult.max():.3f}")
    return [paths["csv"], paths["png"]] + ([paths["sweep"], paths["choice"]] if len(ratios) > 1 else [])
