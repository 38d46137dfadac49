"""KeyDiff: keep the entries whose keys differ most from the layer's average key direction.

Our reading of Park et al. (2025), "KeyDiff: Key Similarity-Based KV Cache Eviction", as kvpress's
KeyDiffPress scores it (read, not copied): the anchor is the mean of a head's unit-normalized keys (all
prompt entries, post-RoPE as stored), and an entry's score is minus its key's cosine similarity to the
anchor. It needs no queries, so it is question-agnostic. kvpress compresses the context alone and has
no window; our with-question protocol compresses the question too, so the last `window` tokens are always
kept (32, as for SnapKV; `keydiff:window=0` is kvpress's `KeyDiffPress`, make check-references). One scoring
after the prefill, as kvpress does by default; the paper's block-wise eviction is `eval --protocol blockwise`
(`engine.blockwise`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.methods.core.base import check_integers, register_scorer
from ripplekv.methods.snapkv import WindowScorer


def key_dissimilarity(state, layer: int) -> torch.Tensor:
    """[H_kv, n]: minus each key's cosine similarity to the mean of its head's unit-normalized keys."""
    keys = state.keys[layer].float()  # [H_kv, n, d]
    anchor = F.normalize(keys, dim=-1).mean(1, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


@register_scorer("keydiff")
@dataclass(frozen=True)
class KeyDiffScorer(WindowScorer):
    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)

    def floor(self) -> int:
        return max(self.window, 1)

    def scores(self, state, layer):
        # of every entry, cut to the prefix below: the window does not change them
        scores = state.memo((key_dissimilarity, layer), lambda: key_dissimilarity(state, layer))
        return scores[:, : state.length - min(self.window, state.length)]
