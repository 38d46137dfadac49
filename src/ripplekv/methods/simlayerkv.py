"""SimLayerKV: layers whose last query looks only at the first and the most recent tokens are "lazy".

Our reading of Zhang et al. (ICLR 2025), "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction",
and of kvpress's SimLayerKVPress (read, not copied). A layer is lazy when the attention of the prompt's last
`n_last` queries (averaged over them and over every query head), summed over the first `n_initial` entries and
the last `n_recent` entries before those queries, exceeds `lazy_threshold`. kvpress's defaults: n_last 1,
n_recent 1024, n_initial 4; a prompt no longer than n_initial + n_recent + n_last has no lazy layer (kvpress
leaves it whole), and neither does lazy_threshold = 1.

Two readings of what a lazy layer keeps:
- `reading=matched` (ours, the default): the budget stays exactly L x H_kv x B. A lazy layer keeps only its
  n_initial sinks and the observation window (the scorer's `window`, 32: 36 entries, or B if that is less); the
  other layers share the rest of the total exactly (equal shares, fitted to what each can hold) and choose by
  SnapKV's scores (`window`, `kernel`, `pooling` as for `snapkv`). With no lazy layer it is `snapkv`; with every
  layer lazy, or other layers unable to hold the rest, every layer gets B and the lazy ones keep sinks + recent.
- `reading=threshold` (kvpress's): a lazy layer keeps n_initial sinks and the last n_recent - n_last entries,
  every other layer keeps the whole prompt; B is not used, so the memory varies per prompt (reports flag it
  `threshold` whatever it kept, leave it out of ranks and place it on the memory axis at its bytes, as for
  `METHOD:threshold=TAU`). It is the reading make check-references holds against SimLayerKVPress.

Default threshold: kvpress's is 1.0, which makes no layer lazy (SimLayerKVPress then compresses nothing); its
docstring recommends 0.9 for Llama 3, 0.65 for Llama 2, 0.8 for Mistral and 0.85 for Qwen. We default to 0.9, the
Llama 3 value (the bundled SmolLM2 is a Llama-architecture model); `lazy_threshold=` sets another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import (
    Allocator,
    check_integers,
    register_allocator,
    register_scorer,
)
from ripplekv.methods.core.budgets import check_budget, fit_counts, integer_budgets
from ripplekv.methods.snapkv import SnapKVScorer, window_attention
from ripplekv.methods.streamingllm import sinks_and_recent

READINGS = ("matched", "threshold")


@dataclass(frozen=True)
class Laziness:
    """SimLayerKV's test of a layer, shared by its allocator and its scorer (the same options reach both)."""

    lazy_threshold: float = 0.9
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4

    def check_laziness(self) -> None:
        if not 0 <= self.lazy_threshold <= 1:
            raise UserError(f"option lazy_threshold must be in [0, 1], got {self.lazy_threshold!r}")
        check_integers({"n_last": self.n_last, "n_recent": self.n_recent})
        check_integers({"n_initial": self.n_initial}, minimum=0)
        if self.n_recent <= self.n_last:
            raise UserError(f"option n_recent must exceed n_last ({self.n_last}), got {self.n_recent!r}")

    def lazy(self, state) -> tuple[bool, ...]:
        """Which layers are lazy on this prompt (once per prefill and options)."""
        key = (lazy_layers, self.lazy_threshold, self.n_last, self.n_recent, self.n_initial)
        return state.memo(key, lambda: lazy_layers(state, *key[1:]))

    def lazy_keeps(self) -> int:
        """Entries a lazy layer keeps in kvpress's reading."""
        return self.n_initial + self.n_recent - self.n_last


def lazy_share(state, layer: int, n_last: int, n_recent: int, n_initial: int) -> float:
    """The last `n_last` queries' attention (mean over them and every query head) on the first `n_initial` and the
    last `n_recent` of the entries before them."""
    mass = window_attention(state, layer, n_last, "SimLayerKV")[..., : state.length - n_last].mean(dim=(0, 1, 2))
    return float(mass[:n_initial].sum() + mass[-n_recent:].sum())


def lazy_layers(state, threshold: float, n_last: int, n_recent: int, n_initial: int) -> tuple[bool, ...]:
    if threshold >= 1 or state.length <= n_initial + n_recent + n_last:
        return (False,) * state.num_layers
    return tuple(lazy_share(state, layer, n_last, n_recent, n_initial) > threshold for layer in range(state.num_layers))


@register_allocator("simlayerkv")
@dataclass(frozen=True)
class SimLayerKVBudgets(Laziness, Allocator):
    reading: str = "matched"
    prompt_dependent = True
    prompt_note = "which layers are lazy depends on each prompt; `ripplekv eval` records the layer budgets per sample"

    def __post_init__(self):
        self.check_heads()
        self.check_laziness()
        if self.reading not in READINGS:
            raise UserError(f"option reading must be one of {', '.join(READINGS)}, got {self.reading!r}")

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"simlayerkv's budgets depend on the prompt: {self.prompt_note}")

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        caps, lazy = state.capacities, self.lazy(state)
        if self.reading == "threshold":
            return [min(self.lazy_keeps(), cap) if flag else cap for flag, cap in zip(lazy, caps)]
        floor = scorer.floor()
        even = integer_budgets([1.0] * len(caps), budget, caps, floor)
        if sum(caps) <= len(caps) * budget or not any(lazy) or all(lazy):
            return even
        small = min(self.n_initial + floor, budget)
        lows = [min(small, cap) if flag else min(floor, budget, cap) for flag, cap in zip(lazy, caps)]
        highs = [min(small, cap) if flag else cap for flag, cap in zip(lazy, caps)]
        total = len(caps) * budget
        if sum(highs) < total:
            return even  # the other layers cannot hold the rest: every layer gets its share
        return fit_counts([0.0 if flag else 1.0 for flag in lazy], total, lows, highs)


@register_scorer("simlayerkv")
@dataclass(frozen=True)
class SimLayerKVScorer(Laziness, SnapKVScorer):
    """SnapKV's choice in the layers that are not lazy; the sinks and the most recent entries in lazy ones."""

    def __post_init__(self):
        super().__post_init__()
        self.check_laziness()

    def requirements(self):
        return super().requirements().union(Requirements(capture_window=self.n_last))

    def decode_policy(self, every: int):
        return None

    def scores(self, state, layer):
        if not self.lazy(state)[layer]:
            return super().scores(state, layer)
        prefix = state.length - min(self.window, state.length)
        order = torch.arange(prefix, dtype=torch.float32, device=state.device).expand(state.num_kv_heads, -1).clone()
        order[:, : self.n_initial] = float(prefix)  # a lazy layer ranks its sinks first, then the most recent
        return order

    def keep(self, state, layer, counts):
        if not self.lazy(state)[layer]:
            return super().keep(state, layer, counts)
        return sinks_and_recent(state, layer, counts, self.n_initial)


def lazy_count(state, **options) -> int:
    """How many layers SimLayerKV calls lazy on this prompt (for reports and checks)."""
    return int(np.sum(Laziness(**options).lazy(state)))
