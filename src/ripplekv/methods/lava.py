"""LAVa: layer budgets from the entropy of each layer's value-weighted window attention; heads compete inside.

Our reading of Shen et al. (arXiv 2509.09754) and of MGDDestiny/Lava (`LavaKVCluster` in
`adaptive_snapkv/monkeypatch/snapkv_utils.py` and its model patch, read, not copied):
- score of a prefix entry for a query head: the window's mean attention to it (window 32, max pooling with
  kernel 7) times the largest L1 norm of any prefix value vector of that head's KV head; a KV head's score
  is the max over its query heads (the `lava` scorer);
- a layer's sparsity is the normalized entropy of its scores over (KV head, entry): H / log(H_kv x m);
  beyond the window every layer keeps, the L x (B - window) entries are shared in proportion to it;
- inside a layer, heads compete AdaKV's way (FFY0's rule) with the safeguard 0.2: `split=adakv`,
  `head_alpha=0.2` by default (`lava:split=even` splits each layer evenly instead).

Where ours differs:
- The reference updates every earlier layer's budget as each layer finishes its prefill (the final budgets
  are the same proportions over all layers); we compute them once from the whole prefill.
- Its per-head floor uses the initial (uniform) prefix budget, not the layer's (a misspelt attribute), so a
  layer given little keeps more than its budget and the total overshoots; ours floors at 0.2 of the
  layer's own budget, and integer budgets make the total exactly L x H_kv x B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.adakv import DEFAULT_ALPHA
from ripplekv.methods.core.base import COMPOSITION, Allocator, check_positive, register_allocator, register_scorer
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.snapkv import SnapKVScorer, check_pooling, pooled, pooling_unused, window_attention


def lava_scores(state, layer: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """LAVa's scores [H_kv, n - window] of one layer (see the module docstring), once per prefill and options."""
    return state.memo((lava_scores, layer, window, kernel, pooling),
                      lambda: _lava_scores(state, layer, window, kernel, pooling))


def _lava_scores(state, layer: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    attention = window_attention(state, layer, window, who="LAVa")  # [H_kv, group, w, n]
    kv_heads, group, _, length = attention.shape
    mean = pooled(attention.mean(2)[..., : length - window], kernel, pooling)  # [H_kv, group, n - window]
    values = state.values[layer][:, : length - window].float()
    largest = values.abs().sum(-1).amax(-1) if values.shape[1] else values.new_zeros(kv_heads)  # [H_kv]
    return (mean * largest[:, None, None]).amax(1)


def normalized_entropy(scores: torch.Tensor) -> float:
    """Entropy of `scores` normalized to a distribution, over log(count): 1 when flat, 0 when one entry holds all."""
    flat = scores.reshape(-1).double()
    if flat.numel() < 2 or float(flat.sum()) <= 0:
        return 0.0
    p = flat / flat.sum()
    return float(-torch.special.xlogy(p, p).sum()) / math.log(flat.numel())


@register_scorer("lava")
@dataclass(frozen=True)
class LAVaScorer(SnapKVScorer):
    """SnapKV's options and checks (window, kernel, pooling), LAVa's scores."""

    def scores(self, state, layer):
        return lava_scores(state, layer, min(self.window, state.length), self.kernel, self.pooling)


@register_allocator("lava")
@dataclass(frozen=True)
class LAVa(Allocator):
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    split: str | None = field(default="adakv", metadata=COMPOSITION)
    prompt_dependent = True
    prompt_note = "`ripplekv eval` records them per sample (layer_budgets in predictions.jsonl)"

    def __post_init__(self):
        self.check_heads()
        check_positive(window=self.window, kernel=self.kernel)
        check_pooling(self.pooling)

    def split_alpha(self):
        return DEFAULT_ALPHA if self.head_alpha is None else self.head_alpha

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)

    def unused_options(self) -> dict[str, str]:
        return pooling_unused(self.kernel, self.pooling)

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"lava's per-layer budgets depend on each prompt's attention; {self.prompt_note}")

    def sparsities(self, state) -> list[float]:
        window = min(self.window, state.length)
        return [normalized_entropy(lava_scores(state, layer, window, self.kernel, self.pooling))
                for layer in range(state.num_layers)]

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        layers, length = state.num_layers, state.length
        if length <= budget:
            return [length] * layers
        floor = min(scorer.floor(), budget)
        sparsity = np.asarray(self.sparsities(state))
        shares = sparsity / sparsity.sum() if sparsity.sum() > 0 else np.full(layers, 1 / layers)
        return integer_budgets((floor + layers * (budget - floor) * shares).tolist(), budget, length, floor)
