"""Layer-level allocators: every head of a layer keeps the same count; layers differ.

- `uniform`: the same budget in every layer (SnapKV, StreamingLLM).
- `pyramid`: PyramidKV's schedule. Beyond the scorer's window, layer 0 gets (2 - 1/beta) times and the
  last layer 1/beta times the average, linearly in between. Unlike the common implementation (integer
  steps that keep ~4.6% more than uniform at B=128), our integer budgets sum exactly to L*B.
- `file`: multipliers from an allocation CSV (`layer,multiplier`, written by `ripplekv allocate`):
  RippleKV's (exponential map) and DepthKV's (proportional map) budgets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.methods.base import Allocator, register_allocator
from ripplekv.methods.tables import check_layer_count, read_multipliers


@register_allocator("uniform")
@dataclass(frozen=True)
class Uniform(Allocator):
    same_budget_every_layer = True


@register_allocator("pyramid")
@dataclass(frozen=True)
class Pyramid(Allocator):
    beta: float = 20.0

    def __post_init__(self):
        self.check_heads()
        if not self.beta >= 1:
            raise UserError(f"option beta must be a number >= 1, got {self.beta!r}")

    def layer_weights(self, num_layers, budget, floor):
        spare = max(budget - floor, 0)
        low = spare / self.beta
        high = 2 * spare - low
        if num_layers == 1:
            return [float(budget)]
        step = (high - low) / (num_layers - 1)
        return [floor + high - step * layer for layer in range(num_layers)]




def read_allocation(path: str | Path) -> tuple[float, ...]:
    """Multipliers by layer from an allocation CSV (`tables.read_multipliers`: finite, none negative, one > 0)."""
    return tuple(read_multipliers(path, "allocation", "run `ripplekv profile` then `ripplekv allocate`"))


@register_allocator("file")
@dataclass(frozen=True)
class FromAllocation(Allocator):
    """Budgets proportional to per-layer multipliers from `ripplekv allocate`."""

    allocation: str | None = None
    multipliers: tuple[float, ...] | None = None

    def __post_init__(self):
        self.check_heads()
        if self.multipliers is None:
            if self.allocation is None:
                raise UserError(
                    "this method needs an allocation: run `ripplekv profile` and `ripplekv allocate` (for depthkv: "
                    "`profile --signal evict`, `allocate --map proportional`), then pass --allocation ALLOC.csv "
                    "(or use `make reproduce`)"
                )
            object.__setattr__(self, "multipliers", read_allocation(self.allocation))
        elif any(m < 0 for m in self.multipliers) or not any(m > 0 for m in self.multipliers):
            # inline multipliers follow an allocation file's rule, checked here before any sample runs
            raise UserError(f"option multipliers must be >= 0 with at least one > 0 (a layer's share of B), got "
                            f"{'/'.join(f'{m:g}' for m in self.multipliers)}")

    def layer_weights(self, num_layers, budget, floor):
        check_layer_count(len(self.multipliers), num_layers, "allocation", "profile and allocate with the same model")
        return [budget * m for m in self.multipliers]
