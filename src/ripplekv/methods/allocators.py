"""Layer-level allocators: every head of a layer keeps the same count; layers differ.

- `uniform`: the same budget in every layer (SnapKV, StreamingLLM).
- `pyramid`: PyramidKV's schedule. Beyond the scorer's window, layer 0 gets (2 - 1/beta) times and the
  last layer 1/beta times the average, linearly in between. Unlike the common implementation (integer
  steps that keep ~4.6% more than uniform at B=128), our integer budgets sum exactly to L*B.
  `pyramid:schedule=kvpress` is kvpress's `PyramidKVPress` instead, for make check-references: the window
  inside the arithmetic sequence (from 2B - B/beta down to B/beta, capped at n - window), each layer's
  budget rounded alone (its total drifts), and uniform B whenever the last layer would hold less than the
  window (below B = beta x window).
- `file`: multipliers from an allocation CSV (`layer,multiplier`, written by `ripplekv allocate`):
  RippleKV's (exponential map) and DepthKV's (proportional map) budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.methods.core.base import FILE, Allocator, register_allocator
from ripplekv.methods.core.budgets import check_budget
from ripplekv.methods.core.tables import check_layer_count, read_multipliers


@register_allocator("uniform")
@dataclass(frozen=True)
class Uniform(Allocator):
    same_budget_every_layer = True


SCHEDULES = ("paper", "kvpress")


def kvpress_pyramid(num_layers: int, budget: int, length: int, window: int, beta: float) -> list[int]:
    """kvpress's PyramidKVPress layer budgets (its `get_layer_budget`, read, not copied), window included."""
    low = budget / beta
    high = 2 * budget - low
    if high >= length - window:
        high = length - window
        low = 2 * budget - high
    if not length >= high >= low >= window:
        return [max(1, budget)] * num_layers
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(high - layer * step) for layer in range(num_layers)]


@register_allocator("pyramid")
@dataclass(frozen=True)
class Pyramid(Allocator):
    beta: float = 20.0
    schedule: str = "paper"

    def __post_init__(self):
        self.check_heads()
        if not self.beta >= 1:
            raise UserError(f"option beta must be a number >= 1, got {self.beta!r}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"option schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    def layer_budgets(self, num_layers, budget, length, floor):
        if self.schedule == "paper":
            return super().layer_budgets(num_layers, budget, length, floor)
        check_budget(budget)
        if length <= budget:
            return [length] * num_layers
        return [min(b, length) for b in kvpress_pyramid(num_layers, budget, length, floor, self.beta)]

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

    allocation: str | None = field(default=None, metadata=FILE)
    multipliers: tuple[float, ...] | None = None

    def __post_init__(self):
        self.check_heads()
        if self.multipliers is None:
            if self.allocation is None:
                raise UserError(
                    "this method needs an allocation: run `ripplekv profile` and `ripplekv allocate` (for depthkv: "
                    "`profile --signal evict`, `allocate --map proportional`), then pass its CSV as {allocation} "
                    "(or use `make reproduce`)", "allocation"
                )
            object.__setattr__(self, "multipliers", read_allocation(self.allocation))
        elif any(m < 0 for m in self.multipliers) or not any(m > 0 for m in self.multipliers):
            # inline multipliers follow an allocation file's rule, checked here before any sample runs
            raise UserError(f"option multipliers must be >= 0 with at least one > 0 (a layer's share of B), got "
                            f"{'/'.join(f'{m:g}' for m in self.multipliers)}")

    def layer_weights(self, num_layers, budget, floor):
        check_layer_count(len(self.multipliers), num_layers, "allocation", "profile and allocate with the same model")
        return [budget * m for m in self.multipliers]
