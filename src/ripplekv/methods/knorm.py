"""KNorm scoring: keep the entries whose keys have the smallest L2 norm (plus the recent window).

Our reading of Devoto et al. (2024), "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression": low key norm goes with high attention, so an entry's score is minus its key's norm. It
needs no queries at all. RoPE rotates pairs of coordinates, so the norm of the stored (post-RoPE) key is
the norm of the key before rotation. As the paper and kvpress's KnormPress, every entry competes, the
last tokens included (`window=0`, the default); `knorm:window=32` always keeps the last 32 tokens (our
earlier default). The paper's code also leaves the first layers uncompressed; that cannot meet a
matched total below `n * layers_skipped / L` entries per head, so it is not an option here (stated in
the README).
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.methods.core.base import check_integers, register_scorer
from ripplekv.methods.snapkv import WindowScorer


@register_scorer("knorm")
@dataclass(frozen=True)
class KNormScorer(WindowScorer):
    window: int = 0

    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)

    def floor(self) -> int:
        return max(self.window, 1)

    def scores(self, state, layer):
        window = min(self.window, state.length)
        return -state.keys[layer][:, : state.length - window].float().norm(dim=-1)
