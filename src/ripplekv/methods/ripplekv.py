"""RippleKV: per-layer budgets from a sensitivity-derived allocation, SnapKV scoring inside each layer.

The allocation CSV (written by `ripplekv allocate`) has columns `layer,multiplier`; multipliers are
turned into exact integer budgets by the same rounding as every other method, so totals match.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.errors import UserError
from ripplekv.methods.base import register
from ripplekv.methods.snapkv import SnapScored


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
    """Multipliers by layer from an allocation CSV; every multiplier must be positive."""
    try:
        values = read_layer_column(path, "multiplier", "allocation", "run `ripplekv profile` then `ripplekv allocate`")
    except UserError as err:
        if "non-numeric" in str(err):
            raise UserError(f"allocation file {path} has non-positive or non-numeric multipliers; all must be > 0") from None
        raise
    if not all(v > 0 for v in values):
        raise UserError(f"allocation file {path} has non-positive or non-numeric multipliers; all must be > 0")
    return tuple(values)


@register("ripplekv")
@dataclass(frozen=True)
class RippleKV(SnapScored):
    name = "ripplekv"
    allocation: str | None = None
    multipliers: tuple[float, ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.multipliers is None:
            if self.allocation is None:
                raise UserError(
                    "ripplekv needs an allocation: run `ripplekv profile` and `ripplekv allocate`, "
                    "then pass --allocation ALLOC.csv (or use `make reproduce`)"
                )
            object.__setattr__(self, "multipliers", read_allocation(self.allocation))

    def layer_targets(self, num_layers, budget):
        if len(self.multipliers) != num_layers:
            raise UserError(
                f"allocation has {len(self.multipliers)} layers but the model has {num_layers}; "
                "profile and allocate with the same model"
            )
        return [budget * m for m in self.multipliers]
