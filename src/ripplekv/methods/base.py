"""What a compression method is: per-layer budgets, and which prompt entries each layer and head keeps.

A method is a small frozen dataclass registered by name. Selections are bool masks [L, H_kv, n], so
kept positions are unique and in order by construction, and heads may keep different counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ripplekv.budgets import check_budget, integer_budgets
from ripplekv.errors import UserError
from ripplekv.prefill import PrefillState

REGISTRY: dict[str, Callable[..., "Method"]] = {}


def register(name: str):
    """Class decorator: make a method available by name (one registry line per method)."""

    def wrap(cls):
        REGISTRY[name] = cls
        return cls

    return wrap


def method_names() -> list[str]:
    return sorted(REGISTRY)


def make_method(name: str, **options) -> "Method":
    """Build a method by name; options a method does not take are ignored."""
    if name not in REGISTRY:
        raise UserError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    cls = REGISTRY[name]
    fields = getattr(cls, "__dataclass_fields__", {})
    return cls(**{k: v for k, v in options.items() if k in fields and v is not None})


@dataclass(frozen=True)
class Method:
    """Base: uniform budgets; subclasses choose entries (and may change budgets)."""

    name = "method"

    def layer_targets(self, num_layers: int, budget: int) -> list[float]:
        """Real-valued per-layer weights; only proportions matter (uniform by default)."""
        return [1.0] * num_layers

    def layer_floor(self) -> int:
        """No layer gets fewer than this many entries (when the budget allows)."""
        return 1

    def layer_budgets(self, num_layers: int, budget: int, length: int) -> list[int]:
        """Exact integer budgets summing to `num_layers * budget` (or all entries for short prompts)."""
        check_budget(budget)
        return integer_budgets(self.layer_targets(num_layers, budget), budget, length, self.layer_floor())

    def keep(self, state: PrefillState, layer: int, count: int) -> torch.Tensor:
        """Bool mask [H_kv, n] keeping `count` entries per head of one layer."""
        raise NotImplementedError

    def select(self, state: PrefillState, budget: int) -> torch.Tensor:
        """Bool mask [L, H_kv, n] for the whole cache at this budget."""
        budgets = self.layer_budgets(state.num_layers, budget, state.length)
        masks = []
        for layer, count in enumerate(budgets):
            if count >= state.length:
                masks.append(torch.ones(state.num_kv_heads, state.length, dtype=torch.bool))
            else:
                masks.append(self.keep(state, layer, count))
        return torch.stack(masks)


def recent_mask(num_heads: int, length: int, count: int) -> torch.Tensor:
    """Keep the last `count` positions in every head."""
    mask = torch.zeros(num_heads, length, dtype=torch.bool)
    if count > 0:
        mask[:, length - count :] = True
    return mask
