"""The per-layer KL a profile measures on one calibration sample: each layer's value cache perturbed by
norm-adaptive noise (RippleKV) or its entries evicted (DepthKV's KL form), every layer a variant of one
prefill, KL at the probe tokens. `settings` is a `profile.ProfileSettings` (kept apart from it, so the
signals that call these need not import the profile command's module).
"""

from __future__ import annotations

import numpy as np
import torch

from ripplekv.engine.cache import VariantOverride
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.probe import ProbeRunner
from ripplekv.tasks.calibration import CalibrationPrompt


def noise_delta(values: torch.Tensor, eta: float, generator: torch.Generator) -> torch.Tensor:
    """eta * ||v||_2 / sqrt(d) * eps per token and KV head: the same relative size in every layer.

    Noise is drawn in float32 on the CPU, so a seed gives the same draw on every device and dtype.
    """
    scale = values.float().norm(dim=-1, keepdim=True) / values.shape[-1] ** 0.5
    eps = torch.randn(values.shape, generator=generator, dtype=torch.float32).to(values.device)
    return eta * scale * eps


def _generator(seed: int, sample_index: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + 10_007 * sample_index + layer)


def profile_requirements(settings) -> Requirements:
    """What a profile's prefill records: the eviction method's needs when it evicts (and the probe's length)."""
    needs = Requirements(capture_window=settings.probe_tokens)
    return needs.union(settings.evict_pruner().requirements()) if settings.signal == "evict" else needs


def evict_count(settings, length: int) -> int:
    """Entries per KV head an evicted layer keeps: by the prune ratio when there is one, else `evict_budget`."""
    from ripplekv.pipeline.taskdrop import kept_count

    ratio = settings.ratio()
    return settings.evict_budget if ratio is None else kept_count(length, ratio)


def layer_overrides(state, settings, seed: int, sample_index: int) -> list[VariantOverride]:
    """One override per layer: layer l's perturbation, to be applied in variant l."""
    overrides = []
    if settings.signal == "evict":
        from ripplekv.pipeline.taskdrop import layer_prunes

        keep = layer_prunes(settings.evict_pruner(), state, evict_count(settings, state.length))
    for layer in range(state.num_layers):
        if settings.signal == "noise":
            delta = noise_delta(state.values[layer], settings.eta, _generator(seed, sample_index, layer))
            overrides.append(VariantOverride(layer, value_delta=delta))
        else:
            bias = torch.zeros(keep[layer].shape, device=state.device).masked_fill(~keep[layer], float("-inf"))
            overrides.append(VariantOverride(layer, key_bias=bias))
    return overrides


@torch.inference_mode()
def profile_prompt(model, prompt: CalibrationPrompt, settings, sample_index: int) -> np.ndarray:
    """KL per (seed, layer) for one sample, from a single prefill of its context."""
    state = prefill_for(model, prompt.context, profile_requirements(settings), reserve=len(prompt.probe))
    return profile_state(model, state, prompt.probe, settings, sample_index)


@torch.inference_mode()
def profile_state(model, state, probe_ids: list[int], settings, sample_index: int) -> np.ndarray:
    """KL per (seed, layer) of the probe tokens over an already prefilled context."""
    runner = ProbeRunner(model, state, probe_ids)
    seeds = settings.seeds if settings.signal == "noise" else 1
    result = np.zeros((seeds, state.num_layers))
    for seed in range(seeds):
        result[seed] = runner.perturbed_kl(layer_overrides(state, settings, seed, sample_index), settings.batch_size)
    return result
