"""PyramidInfer: a compounded cosine schedule of layer budgets, with the recent queries' attention choosing.

Our reading of Yang et al. (arXiv 2405.12532) and of mutonix/pyramidinfer (`modeling_llama_pyramidinfer.py`,
read, not copied): after layer i the prefill keeps the fraction rho_i = (1 - r)(cos(pi i / L) + 1) / 2 + r
(r = 0.9) of the context tokens, chosen by the recent queries' attention averaged over the layer's heads
and the recent queries, with 64 sink tokens always kept; the dropped tokens are gone from every later
layer, so layer l holds prod_{i<l} rho_i of the context plus the recent 20% of the prompt.

How we map it to exact budgets:
- The schedule's shape is kept: beyond its scorer's window, layer l's share of the L x (B - window)
  entries is proportional to prod_{i<l} rho_i, and integer budgets make the total L x H_kv x B (the
  reference is not budget-matched: its recent 20% alone exceeds small budgets).
- The `pyramidinfer` scorer keeps the last `window` (32) tokens (the reference's recent part, scaled to
  a budget) and ranks the rest by the window queries' mean attention averaged over all the layer's query
  heads, so every KV head keeps the same tokens as in the reference; `sinks` (4, not the reference's 64,
  which would fill B=64 alone) are always kept.
- Each layer selects on its own from the full prefill, where the reference's later layers can only keep
  tokens the earlier ones kept (nested sets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import Allocator, check_integers, register_allocator, register_scorer
from ripplekv.methods.snapkv import WindowScorer, window_attention


def retention(num_layers: int, decay: float) -> list[float]:
    """prod_{i<l} rho_i for every layer l (layer 0 keeps everything: 1)."""
    kept, shares = 1.0, []
    for layer in range(num_layers):
        shares.append(kept)
        kept *= (1 - decay) * (math.cos(math.pi * layer / num_layers) + 1) / 2 + decay
    return shares


@register_allocator("pyramidinfer")
@dataclass(frozen=True)
class PyramidInfer(Allocator):
    decay: float = 0.9

    def __post_init__(self):
        self.check_heads()
        if not (isinstance(self.decay, (int, float)) and 0 < self.decay <= 1):
            raise UserError(f"option decay must be in (0, 1], got {self.decay!r}")

    def layer_weights(self, num_layers, budget, floor):
        shares = retention(num_layers, self.decay)
        spare = num_layers * max(budget - floor, 0)
        return [floor + spare * share / sum(shares) for share in shares]


def shared_window_attention(state, layer: int, window: int, sinks: int) -> torch.Tensor:
    """[H_kv, n - window]: the layer's mean window attention, the same for every head, the sinks on top."""
    attention = window_attention(state, layer, window, who="PyramidInfer")  # [H_kv, group, w, n]
    shared = attention.mean((0, 1, 2))[: state.length - window]
    if sinks and shared.numel():
        shared[:sinks] = shared.max() + 1  # the sinks outrank every other entry
    return shared.expand(state.num_kv_heads, -1).clone()


@register_scorer("pyramidinfer")
@dataclass(frozen=True)
class PyramidInferScorer(WindowScorer):
    sinks: int = 4
    same_for_every_head = True  # a layer's mean over all its query heads

    def __post_init__(self):
        check_integers({"window": self.window})
        check_integers({"sinks": self.sinks}, minimum=0)

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)

    def degenerate(self, budget: int) -> str | None:
        """As StreamingLLM's note: sinks that fill what the window leaves of B leave nothing to score."""
        if self.window >= budget:
            return super().degenerate(budget)
        if self.sinks >= budget - self.window:
            return (f"its sinks ({self.sinks}) fill what its window ({self.window}) leaves of the budget, so a layer "
                    f"given {budget} entries keeps only its first and most recent entries (no scoring)")
        return None

    def scores(self, state, layer):
        window = min(self.window, state.length)
        return state.memo((shared_window_attention, layer, window, self.sinks),
                          lambda: shared_window_attention(state, layer, window, self.sinks))
