"""Exact integer per-layer budgets.

Budget B means every layer keeps on average B prompt entries per KV head, so every method keeps exactly
`L * B` entries per head in total (or all `n` per layer when the prompt is no longer than B). Real-valued
per-layer targets (a schedule or multipliers times B) become integers by clamping into `[floor, n]` with
the excess redistributed proportionally, then largest-remainder rounding. Totals never drift.

A layer's capacity is what it can hold: the prompt, or on a sliding-window layer its window
(`engine.adapter.layer_capacities`). The same clamp-and-redistribute rule caps a layer at its capacity and moves what it
cannot hold to the layers that can (`fit_to_capacities`), so every method keeps `min(L * B, sum of
capacities)` entries per head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ripplekv.errors import UserError


def check_budget(budget: int) -> int:
    """Reject budgets a user can mistype: not an integer, or not positive."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise UserError(f"budget must be a positive integer number of entries per layer per KV head, got {budget!r}")
    return budget


def _clamped_sum(targets: Sequence[float], scale: float, lows: Sequence[int], highs: Sequence[int]) -> float:
    return sum(min(hi, max(lo, t * scale)) for t, lo, hi in zip(targets, lows, highs))


def capacities_of(n: int | Sequence[int], num_layers: int) -> list[int]:
    """Per-layer capacities: `n` for every layer (the prompt), or the list given (a sliding layer's is its window)."""
    caps = [int(n)] * num_layers if isinstance(n, (int, np.integer)) else [int(c) for c in n]
    if len(caps) != num_layers:
        raise ValueError(f"{len(caps)} capacities for {num_layers} layers")
    return caps


def fit_counts(targets: Sequence[float], total: int, lows: Sequence[int], highs: Sequence[int]) -> list[int]:
    """Integers proportional to `targets`, each in `[lows[i], highs[i]]`, summing to `total` exactly.

    What a clamped item cannot take (over its high, or under its low) moves to the others in proportion to
    their targets (a bisection on the common scale); largest-remainder rounding, ties to the earlier item.
    `total` must lie within `[sum(lows), sum(highs)]`."""
    count = len(targets)
    if count == 0:
        return []
    if any(not math.isfinite(t) or t < 0 for t in targets):
        raise UserError("per-layer budget weights must be finite and non-negative")
    if not sum(lows) <= total <= sum(highs):
        raise ValueError(f"total {total} outside [{sum(lows)}, {sum(highs)}]")
    weights = list(targets) if sum(targets) > 0 else [1.0] * count
    # Find the scale at which the clamped real counts sum to the total (monotone in the scale: bisection).
    low, high = 0.0, 1.0
    while _clamped_sum(weights, high, lows, highs) < total:
        high *= 2.0
        if high > 1e300:  # all weights zero except some: the rest sit at their lows
            break
    for _ in range(200):
        mid = (low + high) / 2.0
        if not low < mid < high:  # adjacent floats: every further step would leave low and high as they are
            break
        if _clamped_sum(weights, mid, lows, highs) < total:
            low = mid
        else:
            high = mid
    real = [min(hi, max(lo, w * high)) for w, lo, hi in zip(weights, lows, highs)]
    counts = [min(hi, max(lo, math.floor(r))) for r, lo, hi in zip(real, lows, highs)]
    # Largest remainder first; ties go to the earlier item. Loops fix any off-by-one from float error.
    order = sorted(range(count), key=lambda i: (-(real[i] - math.floor(real[i])), i))
    while sum(counts) < total:
        grown = False
        for i in order:
            if sum(counts) == total:
                break
            if counts[i] < highs[i]:
                counts[i] += 1
                grown = True
        if not grown:
            break
    for i in reversed(order):
        if sum(counts) <= total:
            break
        if counts[i] > lows[i]:
            counts[i] -= 1
    assert sum(counts) == total, "budget allocation failed to reach the exact total"
    return counts


def integer_budgets(targets: Sequence[float], budget: int, n: int | Sequence[int], floor: int = 1) -> list[int]:
    """Per-layer integer budgets proportional to `targets`, each in `[min(floor, budget, c_l), c_l]`, summing
    to `min(L*B, sum of c_l)`.

    `n` is every layer's capacity (the prompt length) or a list of them (a sliding-window layer holds at most
    its window: `engine.adapter.layer_capacities`). `targets` are non-negative weights (only their proportions matter).
    When the capacities hold no more than `L*B` entries every layer keeps all it can hold.
    """
    check_budget(budget)
    num_layers = len(targets)
    if num_layers == 0:
        return []
    caps = capacities_of(n, num_layers)
    if sum(caps) <= num_layers * budget:
        return caps
    lows = [min(floor, budget, cap) for cap in caps]
    return fit_counts(targets, num_layers * budget, lows, caps)


def fit_layers(shares: Sequence[int], caps: Sequence[int]) -> list[int]:
    """Per-layer budgets (entries per KV head) fitted to what each layer can hold: a layer over its capacity keeps
    its capacity and what it cannot hold moves to the layers that can, in proportion to their shares (`fit_counts`).
    The total stays the shares' (or every layer's capacity, when that is less); shares that fit are unchanged."""
    shares = [int(s) for s in shares]
    if all(share <= cap for share, cap in zip(shares, caps)):
        return shares
    total = min(sum(shares), sum(int(c) for c in caps))
    return fit_counts([float(s) for s in shares], total, [0] * len(shares), [int(c) for c in caps])


def fit_to_capacities(counts: np.ndarray, caps: Sequence[int]) -> np.ndarray:
    """An allocator's `[L, H_kv]` counts, made to fit layers that hold less than the prompt (the one rule for
    every method on a model with sliding-window layers, docs/methods.md "Hybrid attention").

    Each layer's total is capped at `H_kv x c_l`; what a capped layer cannot hold moves to the layers that can,
    in proportion to their totals (`fit_counts`); within a layer its heads keep their proportions, each
    capped at the layer's capacity. The grand total stays the allocator's (or every layer's capacity, when
    that is less). A matrix that already fits is returned unchanged."""
    counts = np.asarray(counts, dtype=np.int64)
    caps_row = np.asarray(caps, dtype=np.int64)[:, None]
    if (counts <= caps_row).all():
        return counts
    layers, heads = counts.shape
    held = [heads * int(c) for c in caps]
    row_totals = fit_layers(counts.sum(1).tolist(), held)
    fitted = np.zeros_like(counts)
    for layer in range(layers):
        row = counts[layer].astype(float).tolist()
        fitted[layer] = fit_counts(row, row_totals[layer], [0] * heads, [int(caps[layer])] * heads)
    return fitted


def uniform_budgets(num_layers: int, budget: int, n: int | Sequence[int]) -> list[int]:
    """The same budget in every layer (capped at the prompt length); with per-layer capacities, the rule of
    `integer_budgets` (what a layer cannot hold goes to the others)."""
    check_budget(budget)
    if isinstance(n, (int, np.integer)):
        return [min(budget, int(n))] * num_layers
    return integer_budgets([1.0] * num_layers, budget, n)
