"""SqueezeAttention: layers whose attention changes the residual stream least get a smaller budget.

Our reading of Wang et al. (arXiv 2404.04793) and of hetailang/SqueezeAttention (`modify_llama_drop.py`,
read, not copied): per prompt, each layer's importance is the cosine similarity between the residual
stream before and after its self-attention, averaged over tokens; the L similarities are clustered into 3
groups with KMeans; the group with the highest similarity (the layers that change it least) gets the
budget fraction `p` of the average, and the two other groups share the rest equally, so the total is
unchanged. Inside a layer the reference keeps sinks and recent tokens (StreamingLLM, the `squeezeattention`
preset's scorer); any scorer composes (`squeezeattention:scorer=snapkv`).

Where ours differs:
- The similarity is averaged over the last `tokens` (64) prompt tokens, recomputed through the full
  cache (`methods.signals.residual`), not over the whole prompt: the prefill keeps no hidden states, and a second
  full pass would cost a prefill.
- KMeans is made deterministic: in one dimension the best 3-group split of the sorted similarities is
  found exactly (every pair of cut points), where sklearn's KMeans starts from random centres.
- `p` defaults to 0.38, the reference README's LongBench setting (class-3 budget 0.08 of the prompt against
  an initial 0.21); integer budgets make the total exactly L x H_kv x B.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ripplekv.errors import UserError
from ripplekv.methods.core.base import Allocator, check_integers, register_allocator
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.signals.residual import residual_cosines


def three_groups(values) -> np.ndarray:
    """Group labels 0, 1, 2 (by increasing centre) of the best 1-D 3-means split of `values` (fewer groups
    when there are fewer than 3 values); ties go to the earliest cut points, so it is deterministic."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    count = len(values)
    labels = np.zeros(count, dtype=np.int64)
    if count < 3:
        labels[order] = np.arange(count)
        return labels

    def cost(a: int, b: int) -> float:
        part = ordered[a:b]
        return float(((part - part.mean()) ** 2).sum())

    best = None
    for i in range(1, count - 1):
        for j in range(i + 1, count):
            total = cost(0, i) + cost(i, j) + cost(j, count)
            if best is None or total < best[0] - 1e-15:
                best = (total, i, j)
    _, i, j = best
    labels[order[i:j]] = 1
    labels[order[j:]] = 2
    return labels


def squeeze_weights(cosines, p: float) -> list[float]:
    """Per-layer budget multipliers (mean 1): `p` for the group that changes least, the rest shared evenly."""
    cosines = np.asarray(cosines, dtype=np.float64)
    layers = len(cosines)
    labels = three_groups(cosines)
    least = labels == labels.max()
    if layers < 3 or np.ptp(cosines) <= 0 or least.all():
        return [1.0] * layers
    rest = (layers - least.sum() * p) / (layers - least.sum())
    return [p if flag else rest for flag in least]


@register_allocator("squeeze")
@dataclass(frozen=True)
class SqueezeAttention(Allocator):
    p: float = 0.38
    tokens: int = 64
    prompt_dependent = True
    prompt_note = "`ripplekv eval` records them per sample (layer_budgets in predictions.jsonl)"

    def __post_init__(self):
        self.check_heads()
        if not (isinstance(self.p, (int, float)) and 0 < self.p <= 1):
            raise UserError(f"option p must be in (0, 1], got {self.p!r}")
        check_integers({"tokens": self.tokens})

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"squeezeattention's per-layer budgets depend on each prompt's residual stream; {self.prompt_note}")

    def cosines(self, state) -> list[float]:
        return state.memo((residual_cosines, self.tokens),
                          lambda: residual_cosines(state.model, state, self.tokens).tolist())

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        if state.length <= budget:
            return [state.length] * state.num_layers
        return integer_budgets(squeeze_weights(self.cosines(state), self.p), budget, state.length, scorer.floor())
