"""LU-KV's solver: which heads give up entries first, at every global compression ratio.

Our reading of arXiv 2602.08585 and of its `step2_compute_curve.py` (through their public descriptions; see
docs/methods.md). For one prompt, head (l, h) evicts its unprotected entries in the order of its scorer
(lowest score first); evicting the k first costs C(k), the oracle importance they carry. The exact problem
(minimise the summed loss over heads at a total number of evictions) is not convex per head, so LU-KV
relaxes each C to its lower convex hull: the hull's slopes, the marginal cost of each further eviction,
never decrease, and they are the isotonic (PAVA) fit of the per-eviction costs (`scipy.optimize.
isotonic_regression`). The greedy then evicts, one entry at a time, from the head whose next marginal cost
is lowest (ties: the lower (layer, head), then the earlier eviction), which is optimal for the relaxed
problem; a head stops at its floor, max(round(1% of n), sink + window). At each global ratio rho_i =
i / 100 (i = 1..99) the first round(rho_i x heads x n) evictions (protected entries counted in n) give each
head's prune ratio; the allocations are nested in rho. `layerwise=True` (the reference script's default)
ranks all layers' heads together, False gives every layer its own greedy and its own share rho.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import isotonic_regression

RATIOS = np.arange(1, 100) / 100  # the curve's rows: global prune ratios 0.01 .. 0.99
FLOOR_SHARE = 0.01  # a head keeps at least this share of n (and its protected entries)


def hull_slopes(costs: np.ndarray) -> np.ndarray:
    """The marginal costs of evicting 1, 2, ... entries on the lower convex hull of k -> costs[:k].sum()
    (the isotonic non-decreasing fit of `costs`, unit weights)."""
    if len(costs) == 0:
        return np.zeros(0)
    return np.asarray(isotonic_regression(np.asarray(costs, dtype=np.float64), increasing=True).x)


def eviction_costs(importance: np.ndarray, scores: np.ndarray, sink: int, window: int) -> np.ndarray:
    """One head's per-eviction oracle costs [n - sink - window], its unprotected entries in the scorer's order
    (lowest score first; equal scores: the earlier position first)."""
    length = len(importance)
    middle = np.arange(min(sink, length), max(length - window, min(sink, length)))
    order = middle[np.argsort(scores[middle], kind="stable")]
    return importance[order]


def head_floor(length: int, sink: int, window: int) -> int:
    return min(length, max(int(round(FLOOR_SHARE * length)), sink + window))


def greedy_evictions(slopes: list[np.ndarray], limits: list[int], totals: list[int]) -> np.ndarray:
    """Evictions per head [len(totals), heads] after the first `totals[i]` steps of the greedy over the heads'
    non-decreasing marginal costs `slopes` (head h at most `limits[h]` evictions). Merging the heads' sorted
    lists by (cost, head, step) is the min-heap's order, so one stable sort stands for the heap."""
    capped = [np.asarray(s[: max(limit, 0)], dtype=np.float64) for s, limit in zip(slopes, limits)]
    costs = np.concatenate(capped) if capped else np.zeros(0)
    owner = np.concatenate([np.full(len(s), head) for head, s in enumerate(capped)]).astype(np.int64)
    order = owner[np.argsort(costs, kind="stable")]  # concatenated by (head, step): ties keep that order
    out = np.zeros((len(totals), len(slopes)), dtype=np.int64)
    for row, total in enumerate(totals):
        out[row] = np.bincount(order[: min(max(total, 0), len(order))], minlength=len(slopes))
    return out


def prune_ratios(importance: np.ndarray, scores: np.ndarray, sink: int, window: int, layerwise: bool = True,
                 ratios: np.ndarray = RATIOS) -> np.ndarray:
    """Per-head prune ratios [len(ratios), L, H] of one prompt from its oracle importance and scorer scores
    (both [L, H, n]); the first `sink` and last `window` entries are never evicted."""
    layers, heads, length = importance.shape
    floor = head_floor(length, sink, window)
    slopes = [[hull_slopes(eviction_costs(importance[l, h], scores[l, h], sink, window)) for h in range(heads)]
              for l in range(layers)]
    out = np.zeros((len(ratios), layers, heads))
    groups = [list(range(layers))] if layerwise else [[l] for l in range(layers)]
    for group in groups:
        flat = [slopes[l][h] for l in group for h in range(heads)]
        totals = [int(round(rho * len(flat) * length)) for rho in ratios]
        evicted = greedy_evictions(flat, [length - floor] * len(flat), totals)
        out[:, group, :] = evicted.reshape(len(ratios), len(group), heads) / length
    return out
