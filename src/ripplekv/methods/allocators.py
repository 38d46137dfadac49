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

import numpy as np
import pandas as pd

from ripplekv.errors import UserError
from ripplekv.methods.base import Allocator, register_allocator


@register_allocator("uniform")
@dataclass(frozen=True)
class Uniform(Allocator):
    pass


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




def read_layer_column(path: str | Path, column: str, kind: str, remedy: str) -> list[float]:
    """`column` ordered by layer from a CSV whose `layer` column lists 0..L-1 once each (missing file,
    missing columns, bad layers or non-numbers are one-line UserErrors naming the file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{kind} file {path} does not exist; {remedy}")
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise UserError(f"{kind} file {path} is not a readable CSV ({err.__class__.__name__})") from None
    missing = {"layer", column} - set(table.columns)
    if missing:
        raise UserError(f"{kind} file {path} lacks column(s) {', '.join(sorted(missing))}; expected layer,{column}")
    layers = pd.to_numeric(table["layer"], errors="coerce")
    values = pd.to_numeric(table[column], errors="coerce")
    if layers.isna().any() or sorted(layers.astype(int).tolist()) != list(range(len(table))):
        raise UserError(f"{kind} file {path} must list layers 0..{len(table) - 1} exactly once each")
    if values.isna().any() or not np.isfinite(values.to_numpy(dtype=float)).all():
        raise UserError(f"{kind} file {path} has missing or non-numeric {column} values")
    return [float(v) for v in values.to_numpy(dtype=float)[layers.astype(int).to_numpy().argsort()]]


def read_allocation(path: str | Path) -> tuple[float, ...]:
    """Multipliers by layer from an allocation CSV: none negative, at least one positive (a layer at 0
    keeps only its scorer's floor, as DepthKV's proportional map gives a layer with no sensitivity)."""
    bad = f"allocation file {path} has negative or non-numeric multipliers; all must be >= 0 and one > 0"
    try:
        values = read_layer_column(path, "multiplier", "allocation", "run `ripplekv profile` then `ripplekv allocate`")
    except UserError as err:
        if "non-numeric" in str(err):
            raise UserError(bad) from None
        raise
    if not all(v >= 0 for v in values) or not any(v > 0 for v in values):
        raise UserError(bad)
    return tuple(values)


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

    def layer_weights(self, num_layers, budget, floor):
        if len(self.multipliers) != num_layers:
            raise UserError(
                f"allocation has {len(self.multipliers)} layers but the model has {num_layers}; "
                "profile and allocate with the same model"
            )
        return [budget * m for m in self.multipliers]
