"""Global layers first: on a model with sliding-window layers, the layers that see the whole prompt fill up before
the sliding layers get anything beyond their floor.

A baseline for hybrid models (Gemma 2/3: most layers slide over the last few hundred tokens, a few read the whole
prompt). Uniform budgets already cap a sliding layer at what it holds and move the rest to the others
(`budgets.integer_budgets`); this allocator asks the simpler question a reader of a hybrid model's results has:
what if the budget went to the global layers first? Every layer gets the scorer's floor (its observation window),
the global layers then share what is left evenly up to the prompt, and only the remainder goes to the sliding
layers, evenly. The total is `L x B` exactly, as for every allocator. On a model without sliding layers (or with
every layer sliding) it is uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.methods.core.base import Allocator, register_allocator
from ripplekv.methods.core.budgets import check_budget, fit_counts, integer_budgets


def global_first_budgets(capacities: list[int], length: int, budget: int, floor: int) -> list[int]:
    """Per-layer budgets: floors, then the global layers (capacity = the prompt) up to the prompt, then the rest."""
    check_budget(budget)
    layers = len(capacities)
    sliding = [cap < length for cap in capacities]
    if not any(sliding) or all(sliding):
        return integer_budgets([1.0] * layers, budget, capacities, floor)
    total = min(layers * budget, sum(capacities))
    lows = [min(floor, budget, cap) for cap in capacities]
    spare = total - sum(lows)
    groups = ([i for i in range(layers) if not sliding[i]], [i for i in range(layers) if sliding[i]])
    counts = [0] * layers
    for members in groups:
        room = sum(capacities[i] - lows[i] for i in members)
        share = min(spare, room)
        spare -= share
        given = fit_counts([1.0] * len(members), sum(lows[i] for i in members) + share, [lows[i] for i in members],
                           [capacities[i] for i in members])
        for i, count in zip(members, given):
            counts[i] = count
    return counts


@register_allocator("globalfirst")
@dataclass(frozen=True)
class GlobalFirst(Allocator):
    prompt_dependent = True  # which layers fill first depends on the prompt's length against the windows
    prompt_note = "its per-layer budgets depend on which layers hold less than the prompt; eval records them per sample"

    def prompt_budgets(self, state, budget, scorer) -> list[int]:
        return global_first_budgets(state.capacities, state.length, budget, scorer.floor())
