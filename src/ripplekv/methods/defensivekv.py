"""DefensiveKV: a robust (worst-case) aggregation of the window's attention, with CriticalKV's value factor.

Our reading of Feng et al. (ICLR 2026), "Taming the Fragility of KV Cache Eviction in LLM Inference", and
of FFY0/DefensiveKV's EfficientDefensiveKVPress (read, not copied). Mean attention over the observation
window trusts that future queries look like the average window query; DefensiveKV defends against the
worst case instead:
1. each window query's attention over the prefix (every query head) is smoothed by average pooling
   (kernel 5, zero padding counted) and rescaled to keep that query's attention mass;
2. an entry's score is its *maximum* over the window queries and the query heads of its KV head, floored
   at the head's mean score (so no entry is ranked below the average);
3. times CriticalKV's value factor ||v W_o||_1 (mean over the group), normalized over the layer's KV heads;
4. a first stage as in CriticalKV: per head, the entries that carry 0.9 - b of the mean window attention
   (most first; b is the mass on the last `window` prefix entries, as the reference computes it) are
   ranked above all others (at the layer's top score plus their attention share, so a budget too small
   for them all keeps the most attended ones, which the reference's cap does too).
The window itself (32) is always kept. `defensivekv` splits each layer's budget among its heads by these
scores with no safeguard (AdaKV's split with alpha 0, as the reference's head-wise press);
`layer-defensivekv` lets all layers compete (the `global` allocator), the reference's layer-level form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_positive, register_scorer
from ripplekv.methods.criticalkv import projected_value_norms
from ripplekv.methods.snapkv import WindowScorer, window_attention


def defensive_scores(state, layer: int, window: int, kernel: int, threshold: float) -> torch.Tensor:
    """DefensiveKV's scores [H_kv, n - window] of one layer (see the module docstring), once per prefill and options."""
    return state.memo((defensive_scores, layer, window, kernel, threshold),
                      lambda: _defensive_scores(state, layer, window, kernel, threshold))


def _defensive_scores(state, layer: int, window: int, kernel: int, threshold: float) -> torch.Tensor:
    attention = window_attention(state, layer, window, who="DefensiveKV")  # [H_kv, group, w, n]
    kv_heads, group, _, length = attention.shape
    prefix = attention[..., : length - window]  # [H_kv, group, w, m]
    if prefix.shape[-1] == 0:  # the window is the whole prompt: nothing to rank
        return prefix.new_zeros(kv_heads, 0)
    mass = prefix.sum(-1, keepdim=True)
    pooled = F.avg_pool1d(prefix.reshape(-1, 1, prefix.shape[-1]), kernel, stride=1, padding=kernel // 2)
    pooled = pooled.reshape(prefix.shape[:-1] + (-1,))[..., : prefix.shape[-1]]
    pooled = pooled / pooled.sum(-1, keepdim=True).clamp_min(1e-30) * mass
    worst = pooled.amax(dim=(1, 2))  # [H_kv, m]
    scores = worst.clamp(min=worst.mean(-1, keepdim=True))
    norms = projected_value_norms(state, layer)[:, : length - window]
    scores = scores * (norms / norms.sum(0, keepdim=True).clamp_min(1e-30))
    # the first stage: entries holding `threshold - b` of the mean window attention, most attended first
    average = prefix.mean((1, 2))
    share = average / average.sum(-1, keepdim=True).clamp_min(1e-30)
    bias = float(prefix[..., -window:].sum(-1).mean())
    order = torch.sort(share, dim=-1, descending=True, stable=True)  # ties: the lower position first
    reached = order.values.cumsum(-1) >= threshold - bias
    counts = reached.int().argmax(-1)  # the first rank that reaches it (0 when none does, as the reference)
    first = torch.arange(share.shape[1], device=share.device)[None, :] < counts[:, None]
    marked = torch.zeros_like(first).scatter_(1, order.indices, first)
    return torch.where(marked, scores.max() + share, scores)


@register_scorer("defensivekv")
@dataclass(frozen=True)
class DefensiveKVScorer(WindowScorer):
    kernel: int = 5
    threshold: float = 0.9

    def __post_init__(self):
        check_positive(window=self.window, kernel=self.kernel)
        if not 0 <= self.threshold <= 1:
            raise UserError(f"option threshold must be in [0, 1], got {self.threshold!r}")

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)  # the window queries' attention, aggregated robustly

    def scores(self, state, layer):
        return defensive_scores(state, layer, min(self.window, state.length), self.kernel, self.threshold)
