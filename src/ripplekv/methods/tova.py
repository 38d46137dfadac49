"""TOVA scoring: keep the entries the last prompt token attends to most.

Our reading of TOVA (Oren et al., 2024), applied once after prefill: an entry's score is the attention
of the last prompt query (a softmax over all prompt keys), averaged over every query head of the layer,
so all heads of a layer keep the same entries (`heads=layer`, the default: the paper's rule, and what
its code and kvpress's TOVAPress do). `tova:heads=kv` averages only over the query heads that share a
KV head (our earlier default). TOVA has no recent window; the last token itself is always kept
(`window=1`), whose query made the scores, as kvpress does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_positive, register_scorer
from ripplekv.methods.snapkv import WindowScorer, window_attention

HEADS = ("kv", "layer")


def last_query_attention(state, layer: int) -> torch.Tensor:
    """Attention [H_kv, group, n] (float32) of the last prompt query over every prompt key."""
    # the last query sees every key
    return state.memo((last_query_attention, layer), lambda: window_attention(state, layer, 1, who="TOVA")[:, :, 0])


@register_scorer("tova")
@dataclass(frozen=True)
class TOVAScorer(WindowScorer):
    window: int = 1
    heads: str = "layer"

    def __post_init__(self):
        if self.heads not in HEADS:
            raise UserError(f"option heads must be one of {', '.join(HEADS)}, got {self.heads!r}")
        check_positive(window=self.window)

    @property
    def same_for_every_head(self) -> bool:
        return self.heads == "layer"

    def requirements(self) -> Requirements:
        return Requirements(capture_window=1)  # the last prompt token's query, whatever window is kept

    def decode_policy(self, every: int):
        from ripplekv.methods.core.decoding import CurrentQuery

        return None if self.chunked else CurrentQuery(self.window, self.heads)  # its decoding evicts entry by entry

    def scores(self, state, layer):
        attention = last_query_attention(state, layer)
        per_head = attention.mean(1) if self.heads == "kv" else attention.mean((0, 1)).expand(attention.shape[0], -1)
        return per_head[:, : state.length - min(self.window, state.length)]
