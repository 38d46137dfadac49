"""Random scoring: the window plus uniformly random prefix entries — a floor for sanity."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.methods.core.base import register_scorer
from ripplekv.methods.snapkv import WindowScorer


@register_scorer("random")
@dataclass(frozen=True)
class RandomScorer(WindowScorer):
    seed: int = 0

    def scores(self, state, layer):
        window = min(self.window, state.length)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        return torch.rand(state.num_kv_heads, state.length - window, generator=generator).to(state.device)
