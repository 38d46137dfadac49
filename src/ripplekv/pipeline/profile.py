"""RippleKV sensitivity: how much does perturbing one layer's value cache move the model's output?

For each calibration sample the prompt is split into a compressible context and the final probe tokens
(the question; optionally the reference answer, teacher-forced). The context is prefilled once; then
every layer's perturbed variant (plus the clean one) runs the probe tokens in one batch over the shared
cache. Only the perturbed layer of each variant differs, stored as a per-variant override, so no K/V is
copied. The signal is KL(p_clean || p_perturbed) of next-token distributions, averaged over probe positions.

Signals: `noise` adds norm-adaptive Gaussian noise to layer l's values, v + eta * ||v|| / sqrt(d) * eps;
`evict` (DepthKV) evicts layer l alone down to `evict_budget` with `evict_method`'s selection (default
`h2o`: DepthKV prunes with its own H2O-like pruner; `snapkv` was our earlier choice) while every other
layer stays full. Set `--evict-budget` to the evaluation budget so the layer is pruned at the global ratio.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from ripplekv.engine import adapter
from ripplekv.engine.cache import CompressedCache, CompressedLayer, VariantOverride
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.engine.prefill import prefill
from ripplekv.runs.safeio import UnitLog, check_output, exclusive, other_files, save_figure, write_csv, write_text

SIGNALS = ("noise", "evict")
DEFAULT_ETA = 0.3
MAX_ETA = 100.0  # far past saturation: KL stops growing once the noise drowns the values
MAX_SEEDS = 1000
SAMPLES_LOG = "samples.jsonl"  # one fsynced line per finished calibration sample: what a rerun resumes from
PROFILE_FILES = ("sensitivity.csv", "per_sample.csv", "profile.json", "sensitivity.png", SAMPLES_LOG)


@dataclass(frozen=True)
class ProfileSettings:
    """Everything that determines a profile (written to profile.json)."""

    eta: float = DEFAULT_ETA
    seeds: int = 2
    signal: str = "noise"
    probe_tokens: int = 16
    evict_budget: int = 128
    batch_size: int = 32
    evict_method: str = "h2o"

    def record(self) -> dict:
        """The settings written to profile.json; a noise profile leaves out the evict pruner it never uses."""
        settings = asdict(self)
        if self.signal == "noise":
            settings.pop("evict_method")
        return settings

    def evict_pruner(self):
        """The method that evicts one layer with `signal=evict`."""
        return make_method(self.evict_method)

    def prefill_options(self) -> dict:
        """What the prefill must record for this signal (H2O's accumulated attention for its pruner)."""
        if self.signal != "evict":
            return {"capture_window": max(64, self.probe_tokens)}
        needs = self.evict_pruner().requirements()
        return {"capture_window": max(64, self.probe_tokens, needs.capture_window), "accumulate": needs.accumulated_attention}

    def check(self) -> None:
        if self.signal not in SIGNALS:
            raise UserError(f"unknown signal {self.signal!r}; choose one of {', '.join(SIGNALS)}")
        if self.signal == "evict" and self.evict_pruner().is_full:
            raise UserError("--evict-method must be a compressing method (e.g. h2o or snapkv), not full")
        if not math.isfinite(self.eta) or self.eta <= 0 or self.eta > MAX_ETA:
            raise UserError(f"--eta must be a number in (0, {MAX_ETA:g}] (noise relative to each value vector's RMS; "
                            f"0 would perturb nothing), got {self.eta}")
        if self.seeds < 1 or self.probe_tokens < 1 or self.batch_size < 1:
            raise UserError("--seeds, --probe-tokens and --batch-size must be positive integers")
        if self.seeds > MAX_SEEDS:
            raise UserError(f"--seeds must be at most {MAX_SEEDS} (noise draws per sample), got {self.seeds}")


@dataclass
class CalibrationPrompt:
    """One calibration sample: its id, the context to compress, and the probe tokens after it."""

    sample_id: str
    context: list[int]
    probe: list[int]


def split_prompt(sample_id: str, prompt_ids: list[int], probe_tokens: int, answer_ids=None) -> CalibrationPrompt:
    """Context = all but the last `probe_tokens` prompt tokens; probe = those tokens (+ the answer)."""
    if len(prompt_ids) <= probe_tokens + 1:
        raise UserError(f"calibration sample {sample_id} has {len(prompt_ids)} tokens, too short for {probe_tokens} probe tokens")
    return CalibrationPrompt(sample_id, list(prompt_ids[:-probe_tokens]), list(prompt_ids[-probe_tokens:]) + list(answer_ids or []))


def noise_delta(values: torch.Tensor, eta: float, generator: torch.Generator) -> torch.Tensor:
    """eta * ||v||_2 / sqrt(d) * eps per token and KV head: the same relative size in every layer.

    Noise is drawn in float32 on the CPU, so a seed gives the same draw on every device and dtype.
    """
    scale = values.float().norm(dim=-1, keepdim=True) / values.shape[-1] ** 0.5
    eps = torch.randn(values.shape, generator=generator, dtype=torch.float32).to(values.device)
    return eta * scale * eps


def _generator(seed: int, sample_index: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + 10_007 * sample_index + layer)


def layer_overrides(state, settings: ProfileSettings, seed: int, sample_index: int) -> list[VariantOverride]:
    """One override per layer: layer l's perturbation, to be applied in variant l."""
    overrides = []
    if settings.signal == "evict":
        keep = settings.evict_pruner().select(state, settings.evict_budget)
    for layer in range(state.num_layers):
        if settings.signal == "noise":
            delta = noise_delta(state.values[layer], settings.eta, _generator(seed, sample_index, layer))
            overrides.append(VariantOverride(layer, value_delta=delta))
        else:
            bias = torch.zeros(keep[layer].shape, device=state.device).masked_fill(~keep[layer], float("-inf"))
            overrides.append(VariantOverride(layer, key_bias=bias))
    return overrides


def kl_per_variant(clean: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """KL(clean || perturbed) of log-prob rows [.., P, vocab], averaged over probe positions."""
    return (clean.exp() * (clean - perturbed)).sum(-1).clamp_min(0.0).mean(-1)


@torch.inference_mode()
def profile_prompt(model, prompt: CalibrationPrompt, settings: ProfileSettings, sample_index: int) -> np.ndarray:
    """KL per (seed, layer) for one sample, from a single prefill of its context."""
    state = prefill(model, prompt.context, reserve=len(prompt.probe), **settings.prefill_options())
    return profile_state(model, state, prompt.probe, settings, sample_index)


class ProbeRunner:
    """Runs the probe tokens over one prefilled context for many single-layer changes.

    A variant changed in layer l equals the clean run below layer l, so it joins the batch only at
    layer l, starting from the clean hidden state there: the batch grows with depth and about half of
    the layer passes are saved. Several variants may join at one layer (routing's (layer, method)
    trials): their key biases (-inf evicts) become that layer's per-variant prompt bias, so no K/V is
    copied. Everything runs through the model's own decoder layers.
    """

    def __init__(self, model, state, probe_ids: list[int]):
        self.model, self.state = model, state
        self.probe = torch.tensor(probe_ids, dtype=torch.long, device=state.device)[None]
        self.positions = torch.arange(state.length, state.length + self.probe.shape[1], device=state.device)[None]
        self.layers = [
            CompressedLayer(state.keys[i][None], state.values[i][None], None, state.length)
            for i in range(state.num_layers)
        ]
        self.clean_inputs: list[torch.Tensor] = []
        self.clean = self._run([], [])[0]

    def _prepare(self, joins: list[int], changes: list[VariantOverride]) -> None:
        """Set each layer's changes for rows that join there (rows are ordered by the layer they join at)."""
        for layer in self.layers:
            layer.keys = layer.values = layer.override = layer.prompt_bias = None
        for index, layer in enumerate(self.layers):
            rows = [row for row, join in enumerate(joins) if join == index]
            biased = [row for row in rows if changes[row].key_bias is not None]
            shifted = [row for row in rows if changes[row].value_delta is not None]
            if len(shifted) > 1:
                raise ValueError("at most one value perturbation per layer and pass")
            if shifted:
                layer.override = VariantOverride(shifted[0], value_delta=changes[shifted[0]].value_delta)
            if biased:
                bias = torch.zeros(rows[-1] + 1, *changes[biased[0]].key_bias.shape, device=self.state.device)
                for row in biased:
                    bias[row] = changes[row].key_bias
                layer.prompt_bias = bias

    def _run(self, joins: list[int], changes: list[VariantOverride]) -> torch.Tensor:
        """Log-probs [rows, P, vocab]: row r is the clean run changed by changes[r] in layer joins[r]
        (`joins` nondecreasing). With no rows: the clean run, recording each layer's clean input."""
        record = not joins
        cache = CompressedCache(self.layers, max(1, len(joins)))
        self._prepare(joins, changes)
        counts = np.bincount(np.asarray(joins, dtype=np.int64), minlength=len(self.layers))
        hidden = adapter.embed(self.model, self.probe) if record else None
        rotary = adapter.rotary(self.model, hidden if record else self.clean_inputs[0], self.positions)
        for index, decoder in enumerate(adapter.decoder_layers(self.model)):
            if record:
                self.clean_inputs.append(hidden)
            elif counts[index]:
                joining = self.clean_inputs[index].repeat(int(counts[index]), 1, 1)
                hidden = joining if hidden is None else torch.cat([hidden, joining])
            if hidden is None:
                continue
            hidden = decoder(
                hidden,
                attention_mask=None,
                position_ids=self.positions,
                cache=cache,
                use_cache=True,
                position_embeddings=rotary,
                ripplekv_cache=cache,
            )
        return torch.log_softmax(adapter.logits(self.model, hidden), -1)

    def perturbed_kl(self, changes: list[VariantOverride], batch_size: int, layers: list[int] | None = None) -> np.ndarray:
        """KL(clean || variant) for each change, applied in layer `layers[i]` (default: change i in layer i);
        `batch_size` variants per pass, grouped by the layer they join at."""
        layers = list(range(len(changes))) if layers is None else list(layers)
        order = np.argsort(np.asarray(layers), kind="stable")
        result = np.zeros(len(changes))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            logprobs = self._run([layers[i] for i in chunk], [changes[i] for i in chunk])
            result[chunk] = kl_per_variant(self.clean[None], logprobs).cpu().numpy()
        return result


@torch.inference_mode()
def profile_state(model, state, probe_ids: list[int], settings: ProfileSettings, sample_index: int) -> np.ndarray:
    """KL per (seed, layer) of the probe tokens over an already prefilled context."""
    runner = ProbeRunner(model, state, probe_ids)
    seeds = settings.seeds if settings.signal == "noise" else 1
    result = np.zeros((seeds, state.num_layers))
    for seed in range(seeds):
        result[seed] = runner.perturbed_kl(layer_overrides(state, settings, seed, sample_index), settings.batch_size)
    return result


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
        data = self.per_sample
        return pd.DataFrame(
            {
                "layer": np.arange(data.shape[1]),
                "kl_mean": data.mean(0),
                "kl_std": data.std(0, ddof=1) if data.shape[0] > 1 else np.zeros(data.shape[1]),
                "kl_median": np.median(data, 0),
                "n_samples": data.shape[0],
            }
        )

    def split_half_rho(self) -> float | None:
        """Spearman rho between the profiles of two disjoint halves (even / odd samples)."""
        from scipy.stats import spearmanr

        if self.per_sample.shape[0] < 2:
            return None
        first, second = self.per_sample[0::2].mean(0), self.per_sample[1::2].mean(0)
        rho = spearmanr(first, second).statistic
        return None if np.isnan(rho) else float(rho)


def calibration_hash(prompts: list[CalibrationPrompt]) -> str:
    """A short fingerprint of the exact calibration tokens, so a profile can be matched to its data."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(p.sample_id.encode())
        digest.update(np.asarray(p.context + p.probe, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def write_profile(profile: Profile, prompts: list[CalibrationPrompt], out: Path) -> dict:
    """sensitivity.csv, per_sample.csv, profile.json and sensitivity.png in `out`."""
    summary = profile.summary()
    write_csv(out / "sensitivity.csv", summary)
    rows = [
        {"sample_id": sid, "seed": seed, "layer": layer, "kl": float(profile.per_seed[i, seed, layer])}
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
    """Mean KL per layer on a log axis; bars span the lowest to highest sample (mean +- std would
    reach below zero, off a log axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    mean = summary["kl_mean"].to_numpy()
    bars = None
    if per_sample is not None and per_sample.shape[0] > 1:
        bars = np.vstack([mean - per_sample.min(0), per_sample.max(0) - mean])
    ax.errorbar(summary["layer"], mean, yerr=bars, marker="o", ms=3, capsize=2,
                label="mean" + (" (bars: lowest to highest sample)" if bars is not None else ""))
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("KL(clean || perturbed)")
    ax.legend(fontsize=8)
    rho = meta.get("split_half_spearman")
    rho_text = f", split-half rho {rho:.2f}" if rho is not None else ""
    ax.set_title(f"{meta['model']}: {meta['signal']} sensitivity, eta={meta['eta']}, {meta['calibration_ids'].__len__()} samples{rho_text}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def calibration_prompts(
    tokenizer,
    count: int,
    probe_tokens: int,
    target_tokens: int = 3500,
    max_length: int = 7500,
    with_answer: bool = False,
    tasks: list[str] | None = None,
    seed: int = 0,
) -> list[CalibrationPrompt]:
    """`count` prompts from the offline suite's calibration split, round-robin over its tasks.

    The calibration split is disjoint from the evaluation samples, so profiling never sees them.
    """
    from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples

    if count < 1:
        raise UserError(f"--calib-samples must be at least 1, got {count}")
    chosen = get_tasks("offline", tasks)
    per_task = -(-count // len(chosen))
    pools = [
        (task, load_samples(task, tokenizer, split="calibration", limit=per_task, target_tokens=target_tokens, seed=seed))
        for task in chosen
    ]
    if not any(records for _, records in pools):
        raise UserError("the calibration split is empty; build the offline suite or pass more --calib-samples")
    prompts: list[CalibrationPrompt] = []
    for index in range(per_task):
        for task, records in pools:
            if index < len(records) and len(prompts) < count:
                record = records[index]
                ids = build_prompt_ids(task, record, tokenizer, max_length)
                answer = tokenizer(record["answers"][0], add_special_tokens=False).input_ids if with_answer else None
                prompts.append(split_prompt(record["_id"], ids, probe_tokens, answer))
    return prompts


def profile_unit(settings: ProfileSettings, loaded: tuple, unit: tuple[int, CalibrationPrompt]) -> np.ndarray:
    """One unit of work: KL per (seed, layer) of calibration prompt number `index` (its noise seeds follow the index)."""
    (model, _), (index, prompt) = loaded, unit
    return profile_prompt(model, prompt, settings, index)


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
    check_output(out, kind="dir", inputs=inputs, writes=PROFILE_FILES)
    foreign = other_files(out, PROFILE_FILES)
    if foreign and not any((out / name).is_file() for name in ("profile.json", SAMPLES_LOG)):
        what = "an eval run" if "predictions.jsonl" in foreign else "other files (" + ", ".join(foreign[:3]) + ")"
        raise UserError(f"--out {out} holds {what}, not a profile; pass a new or empty directory")
    return out


def profile_into(out: Path, model_spec, settings: ProfileSettings, *, calib_samples: int, target_tokens: int,
                 with_answer: bool = False, bar=None, device: str = "auto", dtype: str = "auto",
                 workers=None, announce=None) -> tuple[int, dict]:
    """Run (or resume) a profile into `out` and write its outputs; returns (samples, profile.json's data).

    Every finished sample's KL matrix is appended to `samples.jsonl` and fsynced, so a killed run loses
    at most the sample in flight; a rerun with the same settings and calibration data computes only the
    rest, and any other settings are refused. `bar(total, done)` gives (context manager, advance).
    `workers` (a `distributed.Workers` using Ray) spreads the samples over workers that load the model once;
    results arrive in any order and each sample's noise seeds follow its index, so the profile is the same.
    `announce()` is called once every input has been checked (so bad input stays one line).
    """
    from contextlib import closing, nullcontext

    from ripplekv.engine.models import load_model, load_tokenizer, resolve_device_dtype, resolve_model, runtime_info

    settings.check()
    device, dtype = resolve_device_dtype(device, dtype)
    source = resolve_model(model_spec)
    check_profile_dir(out, inputs=[source.location] if source.kind == "gguf" else [])
    tokenizer = load_tokenizer(model_spec)
    prompts = calibration_prompts(tokenizer, calib_samples, settings.probe_tokens, target_tokens,
                                  with_answer=with_answer)
    if announce is not None:
        announce()
    header = {"model": source.label, "model_location": source.location, **settings.record(),
              "calibration_ids": [p.sample_id for p in prompts], "calibration_hash": calibration_hash(prompts)}
    with exclusive(out, "profile"):
        log = UnitLog(out / SAMPLES_LOG, header, remedy="use a new --out directory")
        todo = [(i, p) for i, p in enumerate(prompts) if p.sample_id not in log.done]
        if todo:
            if workers is not None and workers.uses_ray:
                results = worker_runner(model_spec, device, dtype, settings, workers)(todo)
            else:
                model, _, _ = load_model(model_spec, device=device, dtype=dtype)
                results = ((unit, profile_unit(settings, (model, None), unit)) for unit in todo)
            context, advance = bar(len(prompts), len(prompts) - len(todo)) if bar else (nullcontext(), None)
            with context, closing(results):
                for (index, prompt), kl in results:
                    log.append(prompt.sample_id, kl.tolist())
                    if advance is not None:
                        advance(index)
        stacked = np.array([log.done[p.sample_id] for p in prompts], dtype=np.float64)
        profile = Profile([p.sample_id for p in prompts], stacked.mean(1), stacked, settings, source.label,
                          extra={"device": device, "dtype": dtype, **runtime_info(device)})
        return len(prompts), write_profile(profile, prompts, out)
