"""Exact integer per-layer budgets.

Budget B means every layer keeps on average B prompt entries per KV head, so every method keeps exactly
`L * B` entries per head in total (or all `n` per layer when the prompt is no longer than B). Real-valued
per-layer targets (a schedule or multipliers times B) become integers by clamping into `[floor, n]` with
the excess redistributed proportionally, then largest-remainder rounding. Totals never drift.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ripplekv.errors import UserError


def check_budget(budget: int) -> int:
    """Reject budgets a user can mistype: not an integer, or not positive."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise UserError(f"budget must be a positive integer number of entries per layer per KV head, got {budget!r}")
    return budget


def _clamped_sum(targets: Sequence[float], scale: float, lo: int, hi: int) -> float:
    return sum(min(hi, max(lo, t * scale)) for t in targets)


def integer_budgets(targets: Sequence[float], budget: int, n: int, floor: int = 1) -> list[int]:
    """Per-layer integer budgets proportional to `targets`, each in `[min(floor, budget), n]`, summing to `L*B`.

    `targets` are non-negative weights (only their proportions matter). When `n <= budget` every layer
    keeps all `n` entries.
    """
    check_budget(budget)
    num_layers = len(targets)
    if num_layers == 0:
        return []
    if n <= budget:
        return [n] * num_layers
    if any(not math.isfinite(t) or t < 0 for t in targets):
        raise UserError("per-layer budget weights must be finite and non-negative")
    lo, hi, total = min(floor, budget), n, num_layers * budget
    weights = list(targets) if sum(targets) > 0 else [1.0] * num_layers
    # Find the scale at which the clamped real budgets sum to the total (monotone in the scale: bisection).
    low, high = 0.0, 1.0
    while _clamped_sum(weights, high, lo, hi) < total:
        high *= 2.0
        if high > 1e300:  # all weights zero except some: the rest sit at the floor
            break
    for _ in range(200):
        mid = (low + high) / 2.0
        if _clamped_sum(weights, mid, lo, hi) < total:
            low = mid
        else:
            high = mid
    real = [min(hi, max(lo, w * high)) for w in weights]
    counts = [min(hi, max(lo, math.floor(r))) for r in real]
    # Largest remainder first; ties go to the earlier layer. Loops fix any off-by-one from float error.
    order = sorted(range(num_layers), key=lambda i: (-(real[i] - math.floor(real[i])), i))
    while sum(counts) < total:
        grown = False
        for i in order:
            if sum(counts) == total:
                break
            if counts[i] < hi:
                counts[i] += 1
                grown = True
        if not grown:
            break
    for i in reversed(order):
        if sum(counts) <= total:
            break
        if counts[i] > lo:
            counts[i] -= 1
    assert sum(counts) == total, "budget allocation failed to reach the exact total"
    return counts


def uniform_budgets(num_layers: int, budget: int, n: int) -> list[int]:
    """The same budget in every layer (capped at the prompt length)."""
    check_budget(budget)
    return [min(budget, n)] * num_layers
