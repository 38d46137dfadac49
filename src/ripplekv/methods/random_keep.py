"""Random: the window plus uniformly random prefix entries, uniform budgets — a floor for sanity."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.methods.base import register
from ripplekv.methods.snapkv import SnapScored, top_scored_mask


@register("random")
@dataclass(frozen=True)
class RandomKeep(SnapScored):
    name = "random"
    seed: int = 0

    def keep(self, state, layer, count):
        window = min(self.window, state.length, count)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        scores = torch.rand(state.num_kv_heads, state.length - window, generator=generator)
        return top_scored_mask(scores, state.length, window, count)
