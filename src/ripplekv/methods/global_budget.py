"""`global`: every layer and head competes for one budget by the scorer's scores (the layer level of
Layer-DefensiveKV and of KVzip).

Our reading of the layer-wise allocation in FFY0/DefensiveKV (EfficientAdaGlobalScorerPress) and of KVzip's
default (non-layerwise) budget, both read, not copied: the scores of all layers' and heads' candidates
are ranked together and the top ones are kept wherever they are. Here every head first keeps its
scorer's floor (the observation window, always kept as in both references), the rest of the L x H_kv x B
total goes to the top-scored candidates over all layers, and a layer's count (per head on average)
becomes its budget; exact integer budgets then make the total exactly L x H_kv x B. The head level
follows (`split=adakv` with no safeguard unless `head_alpha=` sets one: a layer's heads compete with no safeguard, which
with the layer totals reproduces the global top-k up to a layer's total being a multiple of H_kv);
`global:split=even` splits each layer evenly instead. `granularity=entry` skips the per-layer budgets: each
(layer, head) keeps its floor and what it wins of the one global top-k, so a layer's total need not be a
multiple of H_kv (kvpress's KVzipPress, non-layerwise, as make check-references holds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.core.base import COMPOSITION, Allocator, register_allocator, top_indices
from ripplekv.methods.core.budgets import check_budget, integer_budgets

GRANULARITIES = ("layer", "entry")


@register_allocator("global")
@dataclass(frozen=True)
class GlobalBudgets(Allocator):
    split: str | None = field(default="adakv", metadata=COMPOSITION)
    granularity: str = "layer"
    prompt_dependent = True
    prompt_note = ("its per-layer and per-head counts come from ranking every layer's scores together, "
                   "recorded per sample by `ripplekv eval`")

    def __post_init__(self):
        self.check_heads()
        if self.granularity not in GRANULARITIES:
            raise UserError(f"option granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")

    @classmethod
    def splits_itself(cls) -> bool:
        return False  # its own `allocate` bypasses the split only at granularity=entry

    def split_alpha(self):
        return 0.0 if self.head_alpha is None else self.head_alpha  # no safeguard: the global top-k

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"global budgets depend on each prompt's scores; {self.prompt_note}")

    def wins(self, state, budget: int, scorer) -> tuple[int, np.ndarray]:
        """(floor, [L, H_kv] candidates each head wins of the global top L x H_kv x (B - floor))."""
        layers, heads, length = state.num_layers, state.num_kv_heads, state.length
        floor = min(scorer.floor(), budget)
        scores = [scorer.scores(state, layer).float() for layer in range(layers)]  # each [H_kv, m_l]
        spare = layers * heads * (budget - floor)
        # a head's floor takes its top candidates when the floor reaches into the scored part
        ranked = [torch.sort(s, dim=-1, descending=True).values[:, max(floor - (length - s.shape[1]), 0):] for s in scores]
        flat = torch.cat([r.reshape(-1) for r in ranked])
        owner = torch.cat([torch.arange(layer * heads, (layer + 1) * heads).repeat_interleave(r.shape[1])
                           for layer, r in enumerate(ranked)])
        chosen = top_indices(flat, min(spare, flat.numel())) if spare > 0 else flat.new_zeros(0, dtype=torch.long)
        return floor, np.bincount(owner[chosen.cpu()].numpy(), minlength=layers * heads).reshape(layers, heads)

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        layers, heads, length = state.num_layers, state.num_kv_heads, state.length
        if length <= budget:
            return [length] * layers
        floor, won = self.wins(state, budget, scorer)
        weights = [floor + won[layer].sum() / heads for layer in range(layers)]
        return integer_budgets(weights, budget, length, floor)

    def allocate(self, state, budget, scorer):
        if self.granularity == "layer":
            return super().allocate(state, budget, scorer)
        check_budget(budget)
        if state.length <= budget:
            return np.full((state.num_layers, state.num_kv_heads), state.length, dtype=np.int64)
        floor, won = self.wins(state, budget, scorer)
        return (floor + won).astype(np.int64)
