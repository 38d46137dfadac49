"""KNorm scoring: keep the entries whose keys have the smallest L2 norm (plus the recent window).

Our reading of Devoto et al. (2024), "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression": low key norm goes with high attention, so an entry's score is minus its key's norm. It
needs no queries at all. RoPE rotates pairs of coordinates, so the norm of the stored (post-RoPE) key is
the norm of the key before rotation. The last `window` tokens are always kept (32, as for SnapKV).
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.methods.base import check_positive, register_scorer
from ripplekv.methods.snapkv import WindowScorer


@register_scorer("knorm")
@dataclass(frozen=True)
class KNormScorer(WindowScorer):
    def __post_init__(self):
        check_positive(window=self.window)

    def scores(self, state, layer):
        window = min(self.window, state.length)
        return -state.keys[layer][:, : state.length - window].float().norm(dim=-1)
