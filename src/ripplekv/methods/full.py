"""The uncompressed reference: every entry of every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.methods.base import Method, register


@register("full")
@dataclass(frozen=True)
class Full(Method):
    name = "full"

    def layer_budgets(self, num_layers, budget, length):
        return [length] * num_layers

    def select(self, state, budget=None):
        return torch.ones(state.num_layers, state.num_kv_heads, state.length, dtype=torch.bool)
