"""Decoding-phase eviction for the methods that can compress while the model writes (`--decode-budget total`).

Each policy answers, at every step and in every (layer, KV head) over its count, which entry leaves
(`engine.evict` does the bookkeeping): the lowest score among the entries it does not protect.
- `Accumulated` (H2O): every entry's score keeps adding the attention each new query pays it; the most
  recent `recent_count(capacity)` entries are protected, as H2O's recent window (its `h2o_hf` decoding).
- `CurrentQuery` (TOVA): the new query's attention, averaged over the layer's heads (or a KV head's
  group, `heads=kv`); the last `window` entries (the new token) are protected.
- `Rolling` (StreamingLLM): the oldest entry after the sinks leaves.
- `Rescored` (SnapKV and the methods that use its scorer): every `every` steps the held entries are scored
  again as SnapKV scores a prompt, with the last `window` queries (the prompt's window, then decoded
  tokens) as the observation window, pooled over the slots in position order (evicted slots count 0), as
  kvpress's decoding presses re-score; between re-scorings the last scores rank, and entries decoded since
  are kept until scored. The last `window` entries are always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.engine.evict import StepView, first_rank, recent_rank
from ripplekv.methods.signals.column_sums import COLUMN_SUMS


def _zeros(positions: torch.Tensor) -> torch.Tensor:
    return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)


@dataclass(frozen=True)
class Accumulated:
    recent: tuple  # (share, window) of H2O's recent tokens: `H2OScorer.recent_count`
    query_window: int = 0

    def initial(self, state, layer, positions, held):
        gathered = state.signal(COLUMN_SUMS)[layer].float()[None].expand(positions.shape[0], -1, -1)
        return gathered.gather(-1, positions.clamp_min(0)).masked_fill(~held, 0.0)

    def update(self, view: StepView):
        return view.scores + view.weights.mean(2)

    def protected(self, view: StepView):
        share, window = self.recent
        recent = torch.minimum(view.capacity, torch.clamp(torch.floor(share * view.capacity.double()).long(), min=window))
        return recent_rank(view.held) < recent[..., None]


@dataclass(frozen=True)
class CurrentQuery:
    window: int
    heads: str
    query_window: int = 0

    def initial(self, state, layer, positions, held):
        return _zeros(positions)

    def update(self, view: StepView):
        per_head = view.weights.mean(2)  # [V, H, S]: a KV head's group averaged
        if self.heads == "kv":
            return per_head
        # heads=layer: the mean over every head of the layer, matched by position (heads may hold different slots)
        variants, heads, slots = per_head.shape
        index = view.positions.clamp_min(0).reshape(variants, -1)
        dense = torch.zeros(variants, view.seen, device=per_head.device)
        dense.scatter_add_(1, index, (per_head * view.held).reshape(variants, -1))
        return (dense / heads).gather(1, index).view(variants, heads, slots)

    def protected(self, view: StepView):
        return recent_rank(view.held) < self.window


@dataclass(frozen=True)
class Rolling:
    sinks: int
    query_window: int = 0

    def initial(self, state, layer, positions, held):
        return positions.float()

    def update(self, view: StepView):
        return view.positions.float()

    def protected(self, view: StepView):
        return first_rank(view.held) < view.capacity.clamp_max(self.sinks)[..., None]


@dataclass(frozen=True)
class Rescored:
    window: int
    kernel: int
    pooling: str
    every: int

    @property
    def query_window(self) -> int:
        return self.window

    def initial(self, state, layer, positions, held):
        return _zeros(positions)  # scored at the first step, before anything is evicted

    def update(self, view: StepView):
        if (view.step - 1) % self.every:
            fresh = view.scores.clone()
            fresh[..., -1] = float("inf")  # decoded since the last scoring: kept until scored
            return fresh
        mass = view.recent_attention(self.window).sum(3).mean(2)  # [V, H, S]
        flat = mass.reshape(-1, 1, mass.shape[-1])
        if self.pooling == "max" and self.kernel > 1:
            flat = F.max_pool1d(flat, self.kernel, stride=1, padding=self.kernel // 2)
        elif self.pooling == "avg" and self.kernel > 1:
            flat = F.avg_pool1d(flat, self.kernel, stride=1, padding=self.kernel // 2)
        return flat[..., : mass.shape[-1]].reshape(mass.shape)

    def protected(self, view: StepView):
        return recent_rank(view.held) < self.window
