"""DynamicKV: layer budgets from a global top-k of every layer's window attention.

Our reading of Zhou et al. (arXiv 2412.14838) and of DreamMr/DynamicKV (`dynamic_v11.py`, read, not copied):
per layer, the last `window` prompt queries' attention to each earlier entry is summed over the window and
pooled (kernel 7; average pooling for Llama, max for Mistral/Qwen2; window 8), every query head apart.
All layers' (query head, entry) scores compete in one top-k of L x H_q x (B - window); a layer's budget
beyond its window is proportional to its share of the hits, capped at `ratio_max` x (B - window) (the
reference's `radio_max`: 10 in its cluster class, 5 in its LongBench script's flag; we take 10), and every
head of the layer keeps that many of its own top entries.

Where ours differs:
- The reference recomputes the competition every 4 layers during prefill, because layers not yet run
  cannot compete; with the whole prefill in hand we rank all L layers together once (what its every-4
  recomputation approximates, and the same at its last recomputation; when 4 does not divide L, as with
  SmolLM2's 30 layers, its last recomputation misses the last L mod 4 layers, which keep up to 10 x (B - window)).
- Integer budgets are exact (L x H_kv x B in all), rounded once by largest remainder. The reference
  integer-divides the hits by L and truncates `budget_size x share` (steps of about L / H_q and
  L / radio_max entries) and adds both truncations' remainders to its last layer, which then runs up to
  tens of entries over the same rule in exact arithmetic (`make check-references` prints both).
- Entries are stored per KV head: the `dynamickv` scorer (SnapKV's with window 8 and average pooling)
  averages a KV head's query heads before pooling, where the reference repeats K/V per query head. The
  allocation signal itself keeps every query head apart, as the reference's competition does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import Allocator, check_integers, register_allocator, register_scorer
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.snapkv import SnapKVScorer, check_pooling, pooled, pooling_unused, window_attention


def pooled_head_scores(state, layer: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """[H_q, n - window] float32: each query head's window attention summed over the window, pooled."""
    def compute() -> torch.Tensor:
        attention = window_attention(state, layer, window, who="DynamicKV")  # [H_kv, group, w, n]
        mass = attention.sum(2).reshape(-1, attention.shape[-1])[:, : state.length - window]
        return pooled(mass, kernel, pooling)

    return state.memo((pooled_head_scores, layer, window, kernel, pooling), compute)


def layer_hits(scores: list[torch.Tensor], count: int) -> np.ndarray:
    """How many of the top `count` entries over all layers' scores (each [heads, m]) lie in each layer."""
    flat = torch.cat([s.reshape(-1) for s in scores])
    if count <= 0 or flat.numel() == 0:
        return np.zeros(len(scores), dtype=np.int64)
    chosen = torch.topk(flat, min(count, flat.numel())).indices
    ends = torch.tensor([s.numel() for s in scores], device=flat.device).cumsum(0)
    owner = torch.bucketize(chosen, ends, right=True)  # the layer each chosen index lies in
    return np.bincount(owner.cpu().numpy(), minlength=len(scores))


@register_scorer("dynamickv")
@dataclass(frozen=True)
class DynamicKVScorer(SnapKVScorer):
    """SnapKV's scores at DynamicKV's defaults: window 8, kernel 7, average pooling."""

    window: int = 8
    pooling: str = "avg"


@register_allocator("dynamickv")
@dataclass(frozen=True)
class DynamicKV(Allocator):
    window: int = 8
    kernel: int = 7
    pooling: str = "avg"
    ratio_max: float = 10.0
    prompt_dependent = True
    prompt_note = "`ripplekv eval` records them per sample (layer_budgets in predictions.jsonl)"

    def __post_init__(self):
        self.check_heads()
        check_integers({"window": self.window, "kernel": self.kernel})
        check_pooling(self.pooling)
        if not self.ratio_max >= 1:
            raise UserError(f"option ratio_max must be a number >= 1, got {self.ratio_max!r}")

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)

    def unused_options(self) -> dict[str, str]:
        return pooling_unused(self.kernel, self.pooling)

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"dynamickv's per-layer budgets depend on each prompt's attention; {self.prompt_note}")

    def hits(self, state, budget: int) -> np.ndarray:
        """Each layer's share of the global top L x H_q x (B - window) window-attention scores."""
        window = min(self.window, state.length)
        scores = [pooled_head_scores(state, layer, window, self.kernel, self.pooling) for layer in range(state.num_layers)]
        return layer_hits(scores, state.num_layers * state.num_query_heads * max(budget - window, 0))

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        layers, length = state.num_layers, state.length
        if length <= budget:
            return [length] * layers
        floor = min(scorer.floor(), budget)
        hits = self.hits(state, budget).astype(np.float64)
        spare = layers * (budget - floor)
        shares = hits / hits.sum() if hits.sum() > 0 else np.full(layers, 1 / layers)
        cap = min(length, floor + int(self.ratio_max * (budget - floor)))
        return integer_budgets((floor + spare * shares).tolist(), budget, max(cap, budget), floor)
