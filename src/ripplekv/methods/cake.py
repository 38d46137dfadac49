"""CAKE: per-layer budgets from each layer's attention preference, measured on the prompt itself.

Our reading of CAKE (Qin et al., ICLR 2025) and its released code: for layer l, take the attention A of
the last `window` prompt queries over the prompt (every query head; rows are softmaxes over all keys the
query sees) restricted to the entries before the window. Its spatial dispersion is the entropy
H_l = -sum a log a over heads, window queries and entries; its temporal shift is V_l = the variance of
each entry's attention across the window queries (unbiased), summed over heads and entries. The layer's
preference is P_l = H_l^(1/tau1) * V_l^(1/tau2). Every layer keeps its scorer's window; the rest of the
total, L * (B - window), is shared in proportion to P, and integer budgets make the total exact.

tau1 and tau2 are temperatures the CAKE paper tunes per model and budget (its released table ranges
from 0.4 to 2.3); we default both to 1 (preference = entropy x variance) and expose them
(`cake:tau1=..:tau2=..`). CAKE also evicts in cascade during prefill and ranks entries with its own
indicator (window attention mean + gamma * variance); here the budgets come from the full prefill and
entries are ranked by the scorer (SnapKV's by default), so `cake` differs from `snapkv` only in allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import Allocator, check_integers, register_allocator
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.snapkv import window_attention


def dispersion_and_shift(state, layer: int, window: int) -> tuple[float, float]:
    """(entropy, variance) of the window's attention over the entries before the window, for one layer."""
    def compute() -> tuple[float, float]:
        attention = window_attention(state, layer, window, who="CAKE")  # [H_kv, group, w, n]
        prefix = attention[..., : state.length - window]
        if prefix.shape[-1] == 0 or window < 2:  # nothing before the window: no preference
            return 0.0, 0.0
        entropy = -torch.special.xlogy(prefix, prefix).sum()
        return float(entropy), float(prefix.var(dim=2, correction=1).sum())

    return state.memo((dispersion_and_shift, layer, window), compute)


@register_allocator("cake")
@dataclass(frozen=True)
class CAKE(Allocator):
    tau1: float = 1.0
    tau2: float = 1.0
    window: int = 32
    prompt_dependent = True

    def __post_init__(self):
        self.check_heads()
        for name in ("tau1", "tau2"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UserError(f"option {name} must be a positive number, got {value!r}")
        check_integers({"window": self.window}, minimum=2, why="CAKE measures variance over it")

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)  # entropy and variance of the window's attention

    def preferences(self, state) -> list[float]:
        """P_l for every layer of one prefilled prompt."""
        window = min(self.window, state.length)
        prefs = []
        for layer in range(state.num_layers):
            entropy, shift = dispersion_and_shift(state, layer, window)
            prefs.append(max(entropy, 0.0) ** (1 / self.tau1) * max(shift, 0.0) ** (1 / self.tau2))
        return prefs

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError("cake's per-layer budgets depend on each prompt's attention; `ripplekv eval` records "
                        "them per sample (layer_budgets in predictions.jsonl)")

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        layers, floor = state.num_layers, scorer.floor()
        if state.length <= budget:
            per_layer = [state.length] * layers
        else:
            prefs = np.asarray(self.preferences(state))
            spare = layers * max(budget - floor, 0)
            shares = prefs / prefs.sum() if prefs.sum() > 0 and np.isfinite(prefs).all() else np.full(layers, 1 / layers)
            per_layer = integer_budgets((floor + spare * shares).tolist(), budget, state.length, floor)
        return per_layer
