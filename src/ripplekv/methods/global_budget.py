"""`global`: every layer and head competes for one budget by the scorer's scores (the layer level of
Layer-DefensiveKV and of KVzip).

Our reading of the layer-wise allocation in FFY0/DefensiveKV (EfficientAdaGlobalScorerPress) and of KVzip's
default (non-layerwise) budget, both read, not copied: the scores of all layers' and heads' candidates
are ranked together and the top ones are kept wherever they are. Here every head first keeps its
scorer's floor (the observation window, always kept as in both references), the rest of the L x H_kv x B
total goes to the top-scored candidates over all layers, and a layer's count (per head on average)
becomes its budget; exact integer budgets then make the total exactly L x H_kv x B. The head level
follows (`split=adakv` with no safeguard unless `head_alpha=` sets one: a layer's heads compete with no safeguard, which
with the layer totals reproduces the global top-k); `global:split=even` splits each layer evenly instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.base import COMPOSITION, Allocator, register_allocator, top_indices
from ripplekv.methods.budgets import check_budget, integer_budgets


@register_allocator("global")
@dataclass(frozen=True)
class GlobalBudgets(Allocator):
    split: str | None = field(default="adakv", metadata=COMPOSITION)
    prompt_dependent = True
    prompt_note = ("its per-layer and per-head counts come from ranking every layer's scores together, "
                   "recorded per sample by `ripplekv eval`")

    def split_alpha(self):
        return 0.0 if self.head_alpha is None else self.head_alpha  # no safeguard: the global top-k

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"global budgets depend on each prompt's scores; {self.prompt_note}")

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        layers, heads, length = state.num_layers, state.num_kv_heads, state.length
        if length <= budget:
            return [length] * layers
        floor = min(scorer.floor(), budget)
        scores = [scorer.scores(state, layer).float() for layer in range(layers)]  # each [H_kv, m_l]
        spare = layers * heads * (budget - floor)
        # a head's floor takes its top candidates when the floor reaches into the scored part
        ranked = [torch.sort(s, dim=-1, descending=True).values[:, max(floor - (length - s.shape[1]), 0):] for s in scores]
        flat = torch.cat([r.reshape(-1) for r in ranked])
        owner = torch.cat([torch.full((r.numel(),), layer, dtype=torch.long) for layer, r in enumerate(ranked)])
        chosen = top_indices(flat, min(spare, flat.numel())) if spare > 0 else flat.new_zeros(0, dtype=torch.long)
        won = np.bincount(owner[chosen.cpu()].numpy(), minlength=layers)
        weights = [floor + won[layer] / heads for layer in range(layers)]
        return integer_budgets(weights, budget, length, floor)
