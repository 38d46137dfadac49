"""SnapKV: the observation window's attention over the prefix, pooled, picks the top entries per KV head.

Defaults follow the SnapKV paper and KVCache-Factory: window 32, max pooling with kernel 7. With grouped
KV heads, a KV head's score is the mean over the query heads that share it. The window is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.errors import UserError
from ripplekv.methods.base import Method, recent_mask, register
from ripplekv.prefill import PrefillState

POOLINGS = ("max", "avg", "none")


def window_scores(state: PrefillState, layer: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """Pooled attention mass [H_kv, n - window] that the last `window` queries give each prefix entry."""
    key = ("snapkv", layer, window, kernel, pooling)
    if key in state.scores:
        return state.scores[key]
    if window > state.window_queries[layer].shape[1]:
        raise UserError(f"SnapKV window {window} exceeds the captured window; prefill with capture_window >= {window}")
    queries = state.window_queries[layer][:, -window:].float()  # [H_q, w, d]
    keys = state.keys[layer].float()  # [H_kv, n, d]
    kv_heads, length = keys.shape[0], keys.shape[1]
    group = queries.shape[0] // kv_heads
    logits = torch.matmul(queries.reshape(kv_heads, group * window, -1), keys.transpose(-1, -2)) * state.scaling
    # Window query i sits at position n - w + i and sees keys up to it.
    visible = torch.arange(length)[None, :] <= (length - window + torch.arange(window))[:, None]
    logits = logits.masked_fill(~visible.repeat(group, 1), float("-inf"))
    mass = torch.softmax(logits, dim=-1).view(kv_heads, group, window, length).sum(2).mean(1)
    prefix = mass[:, : length - window]
    if pooling == "max" and kernel > 1:
        prefix = F.max_pool1d(prefix[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    elif pooling == "avg" and kernel > 1:
        prefix = F.avg_pool1d(prefix[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=False)[:, 0]
    prefix = prefix[:, : length - window]
    state.scores[key] = prefix
    return prefix


def top_scored_mask(scores: torch.Tensor, length: int, window: int, count: int) -> torch.Tensor:
    """Keep the window (or its last `count` entries) plus the top `count - window` prefix entries per head."""
    kept_window = min(window, count)
    mask = recent_mask(scores.shape[0], length, kept_window)
    extra = count - kept_window
    if extra > 0:
        top = torch.topk(scores, extra, dim=-1).indices
        mask.scatter_(1, top, True)
    return mask


@dataclass(frozen=True)
class SnapScored(Method):
    """Any method that ranks entries by SnapKV scores (budgets may differ by subclass)."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise UserError(f"unknown pooling {self.pooling!r}; choose one of {', '.join(POOLINGS)}")
        if self.window < 1 or self.kernel < 1:
            raise UserError("SnapKV window and kernel must be positive integers")

    def layer_floor(self) -> int:
        return self.window

    def keep(self, state, layer, count):
        window = min(self.window, state.length)
        if count <= window:
            return recent_mask(state.num_kv_heads, state.length, count)
        scores = window_scores(state, layer, window, self.kernel, self.pooling)
        return top_scored_mask(scores, state.length, window, count)


@register("snapkv")
@dataclass(frozen=True)
class SnapKV(SnapScored):
    """Uniform budgets, SnapKV scoring."""

    name = "snapkv"
