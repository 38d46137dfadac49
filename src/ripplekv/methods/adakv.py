"""AdaKV: inside each layer, heads compete for the layer's budget by their scores.

Our reading of Ada-KV (Feng et al., 2024): a layer's total budget (`H_kv * b_l`, b_l from uniform
budgets) is spent on the top entries across all of the layer's heads together, ranked by the scorer's
scores (SnapKV's window attention: a softmax mass, so heads are comparable); a head's count is the
number of its entries chosen. A safeguard floor keeps every head at least its scorer floor (the
window) plus `alpha` of the rest of an even share, as AdaKV's `floor_alpha` (0.2) does. Totals are exact
by construction: exactly the layer's total is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.base import HEAD_SPLITS, Allocator, register_allocator


def split_by_scores(scores: torch.Tensor, total: int, floor: int, reserved: int) -> np.ndarray:
    """Per-head counts: `floor` each, then the top remaining candidates across heads; sums to `total`.

    `scores` [H, m] rank each head's m candidates (beyond `reserved` always-kept entries).
    """
    heads, candidates = scores.shape
    counts = np.full(heads, floor, dtype=np.int64)
    spare = total - heads * floor
    taken = max(floor - reserved, 0)  # candidates each head already holds through its floor
    if spare <= 0 or candidates <= taken:
        return counts
    ranked = torch.sort(scores.float(), dim=-1, descending=True).values[:, taken:]  # what's left per head
    chosen = torch.topk(ranked.reshape(-1), min(spare, ranked.numel())).indices
    counts += np.bincount((chosen // ranked.shape[1]).cpu().numpy(), minlength=heads)
    return counts


def adakv_split(state, per_layer, scorer, alpha: float | None) -> np.ndarray:
    """AdaKV's head split of every layer's budget (`per_layer[l]` entries per head on average), safeguard
    `alpha` (AdaKV's 0.2 when None). The head level of a composition (`heads=adakv`)."""
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    heads = state.num_kv_heads
    matrix = np.zeros((state.num_layers, heads), dtype=np.int64)
    for layer, count in enumerate(per_layer):
        if count >= state.length:
            matrix[layer] = state.length
            continue
        reserved = min(scorer.floor(), count)
        floor = reserved + math.floor(alpha * (count - reserved))
        if floor >= count:  # nothing left to compete for: every head keeps the even share
            matrix[layer] = count
            continue
        matrix[layer] = split_by_scores(scorer.scores(state, layer), heads * count, floor, reserved)
    return matrix


DEFAULT_ALPHA = 0.2
HEAD_SPLITS["adakv"] = adakv_split


@register_allocator("adakv")
@dataclass(frozen=True)
class AdaKV(Allocator):
    alpha: float = DEFAULT_ALPHA
    needs_prompt = True

    def __post_init__(self):
        self.check_heads()
        if not 0 <= self.alpha <= 1:
            raise UserError(f"option alpha must be in [0, 1], got {self.alpha!r}")

    def allocate(self, state, budget, scorer):
        per_layer = self.layer_budgets(state.num_layers, budget, state.length, scorer.floor())
        return adakv_split(state, per_layer, scorer, self.alpha)
