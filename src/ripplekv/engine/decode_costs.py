"""The decoding cost model's constants for a device: the reference ones (a 2-core CPU) or measured on it.

`memory.plan_groups` cuts the variants of a sample into groups decoded together by a cost model: a step costs
`step_ms` per forward, `variant_ms` more per variant in it and `entry_ms` per variant and prompt entry it
attends to, summed over layers (padding included). The reference constants (`memory.REFERENCE_COSTS`) were
measured on a 2-core CPU with the bundled model. Other devices differ by orders of magnitude (a GPU's forward
is bound by kernel launches and its attention is nearly free), so there they are measured: once per device,
torch version, dtype and model shape, by timing decoding steps of the model itself over synthetic caches
(`measure`), and kept in `decode_costs.json` in ripplekv's cache folder (`models.cache_root`).

A CPU keeps the reference constants unless `RIPPLEKV_DECODE_COSTS=measured`: the groups decide which variants
share a batch, a batch's float32 numbers depend on what shares it, and results/ made on one CPU reproduce
exactly on another only if both plan the same groups (measured constants move with the machine's noise).
`RIPPLEKV_DECODE_COSTS=reference` keeps the reference constants on any device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import numpy as np
import torch

from ripplekv.engine.cache import CompressedCache, CompressedLayer, install
from ripplekv.engine.kept_measurements import device_name, kept_or_measured
from ripplekv.engine.memory import REFERENCE_COSTS, DecodeCosts, StepCosts
from ripplekv.errors import UserError

SETTING = "RIPPLEKV_DECODE_COSTS"
CHOICES = ("reference", "measured")
FILE = "decode_costs.json"
_known: dict[str, DecodeCosts] = {}


def uses_measured(device_type: str, setting: str = "") -> bool:
    """Whether a device of this type plans with measured constants: as `RIPPLEKV_DECODE_COSTS` says, else
    everywhere but on a CPU (see the module docstring)."""
    setting = setting.strip().lower()
    if setting and setting not in CHOICES:
        raise UserError(f"{SETTING} must be one of {', '.join(CHOICES)}, got {setting!r}")
    return setting == "measured" if setting else device_type != "cpu"


def costs_for(model, state) -> DecodeCosts:
    """The constants `memory.plan_groups` plans this model's decoding on `state`'s device with."""
    if not uses_measured(state.device.type, os.environ.get(SETTING, "")):
        return REFERENCE_COSTS
    entry = _entry_name(model, state)
    if entry not in _known:
        _known[entry] = _kept_or_measured(entry, model, state)
    return _known[entry]


def _entry_name(model, state) -> str:
    shape = StepCosts.of(model, state)
    model_shape = (f"{shape.layers} layers, {shape.query_heads}/{shape.kv_heads} heads of {shape.head_dim}, hidden "
                   f"{shape.hidden}, intermediate {shape.intermediate}, vocab {shape.vocab}")
    return (f"{device_name(state.device)} | torch {torch.__version__} | "
            f"{str(state.keys[0].dtype).removeprefix('torch.')} | {model_shape}")


def _kept_or_measured(entry: str, model, state) -> DecodeCosts:
    """The constants kept for `entry` in the cache folder's file, else measured now and kept there."""
    kept = kept_or_measured(FILE, entry, lambda kept: _costs_in(kept) is not None,
                            lambda: dataclasses.asdict(measure(model, state)))
    return _costs_in(kept)


def _costs_in(kept) -> DecodeCosts | None:
    """The constants a kept entry holds, or None when it holds none usable (missing, not numbers, negative)."""
    try:
        values = [float(kept[field.name]) for field in dataclasses.fields(DecodeCosts)]
    except (KeyError, TypeError, ValueError):
        return None
    return DecodeCosts(*values) if all(math.isfinite(value) and value >= 0 for value in values) else None


@torch.inference_mode()
def measure(model, state, lengths=(64, 1024), batches=(1, 4), calls: int = 5) -> DecodeCosts:
    """The cost model fitted (least squares) to one decoding step of `model` timed for each of `batches`
    variants over each of `lengths` prompt entries per layer (synthetic keys and values of `state`'s shapes):
    step ms = step_ms + V x (variant_ms + entry_ms x L x K). Each point is the median of `calls` steps after
    a warm-up; no constant comes out negative. Up to 4 variants, as divergence decoding runs most of its steps
    (on this CPU 8 and more rows take `F.linear`'s slower path, `engine.linear`); the synthetic caches stay small
    beside a sample's own (4 variants of 1024 entries: 189 MB for the bundled model in float32, 537 MB for an 8B
    Llama in bfloat16)."""
    install(model)
    rows, times = [], []
    for length in lengths:
        for count in batches:
            rows.append([1.0, count, count * length * state.num_layers])
            times.append(_step_ms(model, state, count, length, calls))
    fitted = np.linalg.lstsq(np.asarray(rows), np.asarray(times), rcond=None)[0]
    return fitted_costs(fitted)


def fitted_costs(fitted) -> DecodeCosts:
    """`DecodeCosts` from a fit's (step, variant, entry) ms, none below zero (a step never below 1 µs)."""
    step, variant, entry = (float(x) for x in fitted)
    return DecodeCosts(step_ms=max(step, 1e-3), variant_ms=max(variant, 0.0), entry_ms=max(entry, 0.0))


def _step_ms(model, state, count: int, length: int, calls: int) -> float:
    """Median ms of one decoding step: `count` variants, one new token each, over `length` entries per layer."""
    # drawn on the device by a generator of its own: the process's random state is left as it was
    generator = torch.Generator(device=state.device).manual_seed(count * 100003 + length)
    tensors = []
    for layer in range(state.num_layers):  # every layer its own tensors: their reads cost what a real cache's do
        heads, dim = state.keys[layer].shape[0], state.keys[layer].shape[-1]
        tensors.append([torch.randn(count, heads, length, dim, generator=generator, device=state.device,
                                    dtype=state.keys[layer].dtype) for _ in range(2)])
    token = int(state.input_ids[-1]) if state.input_ids is not None and len(state.input_ids) else 0
    ids = torch.full((count, 1), token, dtype=torch.long, device=state.device)
    positions = torch.full((count, 1), length, dtype=torch.long, device=state.device)
    spent = []
    for call in range(calls + 1):
        cache = CompressedCache([CompressedLayer(keys, values, None, length) for keys, values in tensors], count)
        _synchronize(state.device)
        start = time.perf_counter()
        model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, ripplekv_cache=cache,
              logits_to_keep=1)
        _synchronize(state.device)
        if call:  # the first call warms up
            spent.append(1e3 * (time.perf_counter() - start))
    return statistics.median(spent)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
