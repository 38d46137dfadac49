"""Layer sensitivity: how much does changing one layer's cache move the model's output?

For each calibration sample the prompt is split into a compressible context and the final probe tokens
(the question; optionally the reference answer, teacher-forced). The context is prefilled once; then
every layer's perturbed variant (plus the clean one) runs the probe tokens in one batch over the shared
cache. Only the perturbed layer of each variant differs, stored as a per-variant override, so no K/V is
copied. The KL measure is KL(p_clean || p_perturbed) of next-token distributions, averaged over probe positions.

Signals: `noise` (RippleKV) adds norm-adaptive Gaussian noise to layer l's values, v + eta * ||v|| / sqrt(d) * eps;
`evict` (DepthKV) prunes layer l alone with `evict_method`'s selection (default `h2o`: DepthKV prunes with
its own H2O-like pruner) while every other layer stays full, and measures (`measure`)
- `task-drop` (the default, DepthKV as published, `pipeline.taskdrop`): the drop in the task metric of the
  whole prompt's greedy answer, the layer pruned by `prune_ratio` (default 0.6, the paper's headline);
- `kl`: the KL at the probe tokens, the layer evicted to `evict_budget` (or by `prune_ratio` when given).
`infonce` (`pipeline.representation`) is the representation predictor: each layer's InfoNCE loss between
two views of the calibration prompts; the allocation reads its normalised form (a lower bound on mutual
information, clipped at 0) as the sensitivity. A new signal is one more entry in `signals.SAMPLE_MEASURES` (what
one calibration sample gives) and, when it needs every sample at once, in `signals.FINISHERS`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.defaults import EVICTION_METHOD, MEASURES, PROBE_TOKENS, PROFILE_ETA, PROFILE_SEEDS, PRUNE_RATIO, SIGNALS
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.pipeline.layer_kl import (  # noqa: F401  (re-exported: the profile's per-layer KL)
    evict_count,
    layer_overrides,
    noise_delta,
    profile_prompt,
    profile_requirements,
    profile_state,
)
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.pipeline.samples import check_calibration_window
from ripplekv.pipeline.signals import FINISHERS, SAMPLE_MEASURES
from ripplekv.runs.files import PROFILE_FILES, SAMPLES_LOG  # noqa: F401  (re-exported)
from ripplekv.runs.safeio import UnitLog, check_output, exclusive, other_files, save_figure, write_csv, write_text
from ripplekv.tasks.calibration import (  # noqa: F401
    Calibration,
    CalibrationPrompt,
    Draw,
    calibration_hash,
    calibration_prompts,
    split_prompt,
)

DEFAULT_ETA = PROFILE_ETA
MAX_ETA = 100.0  # far past saturation: KL stops growing once the noise drowns the values
MAX_SEEDS = 1000


@dataclass(frozen=True)
class ProfileSettings:
    """Everything that determines a profile (written to profile.json)."""

    eta: float = DEFAULT_ETA
    seeds: int = PROFILE_SEEDS
    signal: str = "noise"
    probe_tokens: int = PROBE_TOKENS
    evict_budget: int = 128
    batch_size: int = 32
    evict_method: str = EVICTION_METHOD
    measure: str = "task-drop"
    prune_ratio: float | None = None  # evict: prune this share of a layer's prompt (None: evict to evict_budget)

    @property
    def kind(self) -> str:
        """What one calibration sample measures: noise, evict-kl, evict-task-drop or infonce."""
        return f"evict-{self.measure}" if self.signal == "evict" else self.signal

    @property
    def value_name(self) -> str:
        """The name of the measured value in the tables: kl, drop or infonce (a loss)."""
        return {"evict-task-drop": "drop", "infonce": "infonce"}.get(self.kind, "kl")

    def ratio(self) -> float | None:
        """The share of a layer pruned: `prune_ratio`, DepthKV's 0.6 for the task drop when none is given."""
        return PRUNE_RATIO if self.prune_ratio is None and self.kind == "evict-task-drop" else self.prune_ratio

    def record(self) -> dict:
        """The settings written to profile.json; the noise and infonce profiles leave out the evict pruner they
        never use, and a KL evict profile without a prune ratio is recorded as before the measure existed (so an
        earlier profile resumes)."""
        settings = asdict(self)
        if self.signal != "evict":
            for name in ("evict_method", "measure", "prune_ratio"):
                settings.pop(name)
        elif self.kind == "evict-kl" and self.prune_ratio is None:  # recorded as before the task drop existed
            settings.pop("measure")
            settings.pop("prune_ratio")
        else:
            settings["prune_ratio"] = self.ratio()
        return settings

    def evict_pruner(self):
        """The method that evicts one layer with `signal=evict`."""
        return make_method(self.evict_method)

    def check(self) -> None:
        if self.signal not in SIGNALS:
            raise UserError(f"unknown signal {self.signal!r}; choose one of {', '.join(SIGNALS)}")
        if self.signal == "evict":
            check_pruner(self.evict_method, self.evict_pruner())
        if self.measure not in MEASURES:
            raise UserError(f"unknown measure {self.measure!r}; choose one of {', '.join(MEASURES)}")
        ratio = self.prune_ratio
        if ratio is not None and not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 0 < ratio < 1):
            raise UserError(f"--prune-ratio must be a share in (0, 1) of a layer's prompt entries to prune, got {ratio}")
        if not math.isfinite(self.eta) or self.eta <= 0 or self.eta > MAX_ETA:
            raise UserError(f"--eta must be a number in (0, {MAX_ETA:g}] (noise relative to each value vector's RMS; "
                            f"0 would perturb nothing), got {self.eta}")
        if self.seeds < 1 or self.probe_tokens < 1 or self.batch_size < 1:
            raise UserError("--seeds, --probe-tokens and --batch-size must be positive integers")
        if self.seeds > MAX_SEEDS:
            raise UserError(f"--seeds must be at most {MAX_SEEDS} (noise draws per sample), got {self.seeds}")


def check_pruner(spec: str, pruner) -> None:
    """An evict profile prunes one layer at a time to the same share in every layer, with the pruner's own
    selection: a pruner must be an allocator x scorer whose allocator gives every layer the same budget (a head
    split inside a layer is kept); one that spreads budgets over layers would keep more in some layers and less
    in others than the ratio asked for, and a ceiling needs an answer a profile never has."""
    from ripplekv.methods import AllocatorScorer

    if getattr(pruner, "is_full", False):
        raise UserError("--evict-method must be a compressing method (e.g. h2o or snapkv), not full")
    if not isinstance(pruner, AllocatorScorer):
        raise UserError(f"--evict-method {spec}: its budgets come from one greedy over every layer, not a selection "
                        "a layer can make alone; an evict profile prunes one layer at a time: name a method with a "
                        "scorer (e.g. h2o or snapkv)")
    if pruner.knows_answer:
        raise UserError(f"--evict-method {spec} is a ceiling (it reads the full cache's answer, which a profile does "
                        "not decode): name a method (e.g. h2o or snapkv)")
    if not pruner.allocator.same_budget_every_layer:
        from ripplekv.methods.router import uniform_spec

        raise UserError(f"--evict-method {spec}: its allocator ({pruner.allocator.name}) spreads the budget over "
                        "layers, but an evict profile prunes each layer alone to the same share; name a method with "
                        f"uniform budgets, e.g. {uniform_spec(pruner.scorer.name)} for its scorer")


def check_given(signal: str, measure: str, given: dict) -> None:
    """Options the command line set (`given`: option -> value, None when not given) that do nothing with the
    chosen signal and measure, or contradict each other, each refused in one line naming what is used instead."""
    set_ = [option for option, value in given.items() if value is not None]
    evict_only = [o for o in set_ if o in ("--evict-method", "--evict-budget", "--measure", "--prune-ratio")]
    if signal != "evict" and evict_only:
        raise UserError(f"{', '.join(evict_only)} applies with --signal evict only (how a pruned layer is chosen and "
                        f"scored); --signal {signal} does not prune: drop it, or pass --signal evict")
    if signal == "evict" and measure == "task-drop" and "--evict-budget" in set_:
        raise UserError("--evict-budget applies to --measure kl; the task drop prunes each layer by --prune-ratio "
                        f"(default {PRUNE_RATIO}): drop --evict-budget, or pass --measure kl")
    if signal == "evict" and measure == "kl" and {"--evict-budget", "--prune-ratio"} <= set(set_):
        raise UserError("--evict-budget and --prune-ratio both set what a pruned layer keeps under --measure kl; "
                        "give one (--prune-ratio wins otherwise)")


@dataclass
class Profile:
    """The outcome of profiling: per-sample matrix and its summary across depth."""

    sample_ids: list[str]
    per_sample: np.ndarray  # [samples, layers], averaged over seeds
    per_seed: np.ndarray  # [samples, seeds, layers]
    settings: ProfileSettings
    model: str
    extra: dict = field(default_factory=dict)

    def summary(self) -> pd.DataFrame:
        """Per layer: the measured value's mean, std and median over samples (`kl_*`, `drop_*` or `infonce_*`);
        a measure that is not a KL adds `sensitivity`, what `allocate` reads: the mean drop clipped at 0, or
        InfoNCE's mutual-information bound clipped at 0 (higher: the layer matters more)."""
        data, name = self.per_sample, self.settings.value_name
        table = pd.DataFrame(
            {
                "layer": np.arange(data.shape[1]),
                f"{name}_mean": data.mean(0),
                f"{name}_std": data.std(0, ddof=1) if data.shape[0] > 1 else np.zeros(data.shape[1]),
                f"{name}_median": np.median(data, 0),
                "n_samples": data.shape[0],
            }
        )
        if name == "drop":
            table["sensitivity"] = np.maximum(data.mean(0), 0.0)
        elif name == "infonce":
            bound = np.asarray(self.extra.get("infonce_mi_bound", np.full(data.shape[1], np.nan)), dtype=float)
            table["sensitivity"] = np.maximum(np.nan_to_num(bound, nan=0.0), 0.0)
        return table

    def split_half_rho(self) -> float | None:
        """Spearman rho between the profiles of two disjoint halves (even / odd samples)."""
        from scipy.stats import spearmanr

        if self.per_sample.shape[0] < 2:
            return None
        first, second = self.per_sample[0::2].mean(0), self.per_sample[1::2].mean(0)
        if np.ptp(first) == 0 or np.ptp(second) == 0:  # a constant half (no drop anywhere) ranks nothing
            return None
        rho = spearmanr(first, second).statistic
        return None if np.isnan(rho) else float(rho)


def write_profile(profile: Profile, prompts: list[CalibrationPrompt], out: Path) -> dict:
    """sensitivity.csv, per_sample.csv, profile.json and sensitivity.png in `out`."""
    summary = profile.summary()
    write_csv(out / "sensitivity.csv", summary)
    rows = [
        {"sample_id": sid, "seed": seed, "layer": layer, profile.settings.value_name: float(profile.per_seed[i, seed, layer])}
        for i, sid in enumerate(profile.sample_ids)
        for seed in range(profile.per_seed.shape[1])
        for layer in range(profile.per_seed.shape[2])
    ]
    write_csv(out / "per_sample.csv", pd.DataFrame(rows))
    meta = {
        "model": profile.model,
        **profile.settings.record(),
        "num_layers": int(profile.per_sample.shape[1]),
        "calibration_ids": profile.sample_ids,
        "calibration_hash": calibration_hash(prompts),
        "split_half_spearman": profile.split_half_rho(),
        **profile.extra,
    }
    write_text(out / "profile.json", json.dumps(meta, indent=2) + "\n")
    plot_profile(summary, meta, out / "sensitivity.png", profile.per_sample)
    return meta


def plot_profile(summary: pd.DataFrame, meta: dict, path: Path, per_sample: np.ndarray | None = None) -> None:
    """Mean value per layer (KL on a log axis); bars span the lowest to highest sample (mean +- std would
    reach below zero, off a log axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    name = next(column[: -len("_mean")] for column in summary.columns if column.endswith("_mean"))
    mean = summary[f"{name}_mean"].to_numpy()
    bars = None
    if per_sample is not None and per_sample.shape[0] > 1:
        bars = np.vstack([mean - per_sample.min(0), per_sample.max(0) - mean])
    ax.errorbar(summary["layer"], mean, yerr=bars, marker="o", ms=3, capsize=2,
                label="mean" + (" (bars: lowest to highest sample)" if bars is not None else ""))
    if name == "kl":
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel({"kl": "KL(clean || perturbed)", "drop": "task score drop (full - one layer pruned)",
                   "infonce": "InfoNCE loss (two views)"}[name])
    ax.legend(fontsize=8)
    rho = meta.get("split_half_spearman")
    rho_text = f", split-half rho {rho:.2f}" if rho is not None else ""
    what = f"eta={meta['eta']}" if meta["signal"] == "noise" else meta.get("measure", "")
    if meta.get("prune_ratio") is not None:
        what += f", {meta['prune_ratio']:.0%} pruned"
    ax.set_title(f"{meta['model']}: {meta['signal']} sensitivity, {what}, {len(meta['calibration_ids'])} samples{rho_text}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def profile_unit(settings: ProfileSettings, loaded: tuple, unit: tuple[int, CalibrationPrompt]) -> np.ndarray:
    """One unit of work: calibration prompt number `index`'s value (KL per (seed, layer) for the KL measures;
    its noise seeds follow the index)."""
    (model, tokenizer), (index, prompt) = loaded, unit
    return SAMPLE_MEASURES[settings.kind](model, tokenizer, prompt, settings, index)


def worker_runner(spec: str | None, device: str, dtype: str, settings: ProfileSettings, workers):
    """A `runner` for `run_profile` that spreads the prompts over Ray workers (each loads the model once)."""
    from functools import partial

    from ripplekv.pipeline import distributed

    setup = partial(distributed.load_model_on_worker, spec, device, dtype)
    work = partial(profile_unit, settings)
    return lambda units: distributed.run_units(units, setup, work, workers, device=device,
                                               label=lambda unit: f"calibration sample {unit[1].sample_id}")


def check_profile_dir(out: Path, inputs=()) -> Path:
    """Before any model work: `out` must be a writable directory, new, empty or an earlier profile."""
    check_output(out, kind="dir", inputs=inputs, writes=PROFILE_FILES, run="profile")
    foreign = other_files(out, PROFILE_FILES)
    if foreign and not any((out / name).is_file() for name in ("profile.json", SAMPLES_LOG)):
        what = "an eval run" if "predictions.jsonl" in foreign else "other files (" + ", ".join(foreign[:3]) + ")"
        raise UserError(f"--out {out} holds {what}, not a profile; pass a new or empty directory")
    return out


def profile_into(out: Path, model: ModelChoice, settings: ProfileSettings, calibration: Calibration, *, bar=None,
                 workers=None, announce=None) -> tuple[int, dict]:
    """Run (or resume) a profile on `calibration`'s prompts into `out` and write its outputs; returns (samples,
    profile.json's data).

    Every finished sample's KL matrix is appended to `samples.jsonl` and fsynced, so a killed run loses
    at most the sample in flight; a rerun with the same settings and calibration data computes only the
    rest, and any other settings are refused. `bar(total, done)` gives (context manager, advance).
    `workers` (a `distributed.Workers` using Ray) spreads the samples over workers that load the model once;
    results arrive in any order and each sample's noise seeds follow its index, so the profile is the same.
    `announce()` is called once every input has been checked (so bad input stays one line). The calibration
    draw is recorded in profile.json when there are several.
    """
    from contextlib import closing, nullcontext

    from ripplekv.engine.models import load_tokenizer, resolve_model, runtime_info

    settings.check()
    calibration.check()
    if settings.kind == "infonce" and calibration.samples < 2:
        raise UserError("--signal infonce contrasts prompts with each other: pass --calib-samples 2 or more")
    model = model.resolved()
    device, dtype = model.device, model.dtype
    source = resolve_model(model.spec)
    check_profile_dir(out, inputs=[source.location] if source.kind == "gguf" else [])
    tokenizer = load_tokenizer(model.spec)
    prompts = calibration.prompts(tokenizer, settings.probe_tokens)
    check_calibration_window(model.spec, prompts, lambda target: calibration.prompts(
        tokenizer, settings.probe_tokens, target_tokens=target), calibration.target_tokens)
    if announce is not None:
        announce()
    header = {"model": source.label, "model_location": source.location, **settings.record(), **calibration.record(),
              "calibration_ids": [p.sample_id for p in prompts], "calibration_hash": calibration_hash(prompts)}
    with exclusive(out, "profile"):
        log = UnitLog(out / SAMPLES_LOG, header, remedy="use a new --out directory")
        todo = [(i, p) for i, p in enumerate(prompts) if p.sample_id not in log.done]
        if todo:
            if workers is not None and workers.uses_ray:
                results = worker_runner(model.spec, device, dtype, settings, workers)(todo)
            else:
                loaded, loaded_tokenizer, _ = model.load()
                results = ((unit, profile_unit(settings, (loaded, loaded_tokenizer), unit)) for unit in todo)
            context, advance = bar(len(prompts), len(prompts) - len(todo)) if bar else (nullcontext(), None)
            with context, closing(results):
                for (index, prompt), kl in results:
                    log.append(prompt.sample_id, kl.tolist())
                    if advance is not None:
                        advance(index)
        stacked = np.array([log.done[p.sample_id] for p in prompts], dtype=np.float64)
        finish = FINISHERS.get(settings.kind)
        stacked, extra = finish(stacked) if finish else (stacked, {})
        profile = Profile([p.sample_id for p in prompts], stacked.mean(1), stacked, settings, source.label,
                          extra={**extra, **calibration.record(), "target_tokens": calibration.target_tokens,
                                 "device": device, "dtype": dtype, **runtime_info(device)})
        return len(prompts), write_profile(profile, prompts, out)
