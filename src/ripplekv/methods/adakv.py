"""AdaKV: inside each layer, heads share the layer's budget by their scores.

Ada-KV (Feng et al., 2024) as its code (FFY0/AdaKV, `AdaptiveSnapKVCluster`) allocates, the default
`rule=ffy0`: every head keeps the scorer's window; of a layer's prefix budget `base = b_l - window` per
head, the top `H_kv * base` prefix entries across all the layer's heads are chosen by the scorer's
scores (SnapKV's window attention: a softmax mass, comparable across heads), `c_h` of them in head h;
head h then keeps its own top `(1 - alpha) * c_h + alpha * base` prefix entries (alpha = `floor_alpha`,
0.2 in its LongBench script). FFY0 rounds each head alone (`round`, with `int(alpha * base)`), so its
totals drift by a few entries; we round the real targets with largest remainders (ties to the lower
head), so a layer keeps exactly `H_kv * b_l`.

`rule=floor` is our earlier rule (kvpress-like): every head first gets its window plus `alpha` of the
rest of an even share, then the top remaining candidates across heads fill the layer's total.
`rule=kvpress` is kvpress's `AdaKVPress` (and `CriticalAdaKVPress`): every head first keeps its top
`int(alpha * b)` entries, the window counted among them (the window scores above every prefix entry), so
the floor is `max(window, int(alpha * b))`; then the top remaining candidates across heads (make
check-references holds it against kvpress).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.core.base import Allocator, register_allocator, register_head_split, top_indices


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
    chosen = top_indices(ranked.reshape(-1), min(spare, ranked.numel()))  # ties: the lower head
    counts += np.bincount((chosen // ranked.shape[1]).cpu().numpy(), minlength=heads)
    return counts


def ffy0_split(scores: torch.Tensor, base: int, alpha: float) -> np.ndarray:
    """FFY0's per-head prefix counts, rounded to sum exactly to `H * base`.

    `scores` [H, m] rank each head's m prefix candidates (m > base).
    """
    heads, candidates = scores.shape
    chosen = top_indices(scores.float().reshape(-1), heads * base)  # ties: the lower head, then position
    selected = np.bincount((chosen // candidates).cpu().numpy(), minlength=heads)
    targets = (1 - alpha) * selected.astype(np.float64) + alpha * base
    counts = np.floor(targets).astype(np.int64)
    short = heads * base - int(counts.sum())
    order = sorted(range(heads), key=lambda h: (-(targets[h] - counts[h]), h))
    for h in order[:short]:
        counts[h] += 1
    return np.minimum(counts, candidates)


RULES = ("ffy0", "floor", "kvpress")
DEFAULT_ALPHA = 0.2


@register_head_split("adakv", default_alpha=DEFAULT_ALPHA)
def adakv_split(state, per_layer, scorer, alpha: float | None, rule: str = "ffy0") -> np.ndarray:
    """AdaKV's head split of every layer's budget (`per_layer[l]` entries per head on average), safeguard
    `alpha` (AdaKV's 0.2 when None); `rule` ffy0 (the published one), floor (our earlier one) or kvpress. The head
    level of a composition (`split=adakv`)."""
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    heads = state.num_kv_heads
    matrix = np.zeros((state.num_layers, heads), dtype=np.int64)
    for layer, count in enumerate(per_layer):
        if count >= state.length:
            matrix[layer] = state.length
            continue
        reserved = min(scorer.floor(), count)
        if rule == "ffy0" and count <= reserved:  # no prefix budget to share
            matrix[layer] = count
            continue
        if rule == "ffy0":
            matrix[layer] = reserved + ffy0_split(scorer.scores(state, layer), count - reserved, alpha)
            continue
        if rule == "kvpress":
            floor = max(reserved, int(alpha * count))
        else:
            floor = reserved + math.floor(alpha * (count - reserved))
        if floor >= count:  # nothing left to compete for: every head keeps the even share
            matrix[layer] = count
            continue
        matrix[layer] = split_by_scores(scorer.scores(state, layer), heads * count, floor, reserved)
    return matrix



@register_allocator("adakv")
@dataclass(frozen=True)
class AdaKV(Allocator):
    alpha: float = DEFAULT_ALPHA
    rule: str = "ffy0"
    prompt_dependent = True
    same_budget_every_layer = True

    def __post_init__(self):
        self.check_heads()
        if not (isinstance(self.alpha, (int, float)) and 0 <= self.alpha <= 1):
            raise UserError(f"option alpha must be in [0, 1], got {self.alpha!r}")
        if self.rule not in RULES:
            raise UserError(f"option rule must be one of {', '.join(RULES)}, got {self.rule!r}")

    @property
    def splits_by_scores(self) -> bool:
        return True

    def allocate(self, state, budget, scorer):
        per_layer = self.layer_budgets(state.num_layers, budget, state.length, scorer.floor())
        return adakv_split(state, per_layer, scorer, self.alpha, self.rule)

    def canonical(self) -> dict:
        """Under FFY0's rule this is uniform layer budgets with the `adakv` head split (what
        `snapkv:split=adakv:head_alpha=alpha` computes), so both spellings are one method."""
        if self.rule != "ffy0":
            return super().canonical()
        return {"name": "uniform", "split": "adakv", "head_alpha": float(self.alpha)}
