"""StreamingLLM scoring: attention sinks (the first tokens) plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.methods.core.base import Scorer, check_integers, per_head, recent_mask, register_scorer


@register_scorer("recency")
@dataclass(frozen=True)
class SinksAndRecent(Scorer):
    sinks: int = 4
    same_for_every_head = True  # positions only

    def __post_init__(self):
        check_integers({"sinks": self.sinks}, minimum=0)

    def degenerate(self, budget: int) -> str | None:
        if self.sinks >= budget:
            return (f"its sinks ({self.sinks}) are at least the budget, so a layer given {budget} entries keeps only "
                    "its first entries (no recent tokens)")
        return None

    def decode_policy(self, every: int):
        from ripplekv.methods.core.decoding import Rolling

        return Rolling(self.sinks)

    def scores(self, state, layer):
        """Later tokens score higher (sinks are kept first by `keep`); the last token is the floor."""
        order = torch.arange(state.length - 1, dtype=torch.float32, device=state.device)
        return order.expand(state.num_kv_heads, -1).clone()

    def keep(self, state, layer, counts):
        return sinks_and_recent(state, layer, counts, self.sinks)


def sinks_and_recent(state, layer: int, counts, sinks: int):
    """Bool [H_kv, n]: per head, the first `sinks` entries and the most recent rest of its count (SimLayerKV's lazy
    layers keep the same)."""

    def build(heads, count):
        # a sliding layer that no longer holds the first tokens has no sinks to keep (the model let them go)
        kept_sinks = min(sinks, count) if state.held_from(layer) == 0 else 0
        mask = recent_mask(state.num_kv_heads, state.length, count - kept_sinks, state.device)[heads]
        mask[:, :kept_sinks] = True
        return mask

    return per_head(counts, build)
