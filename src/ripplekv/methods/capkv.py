"""CapKV: keep the entries that add the most capacity to a query-weighted span of the values.

Our reading of CAPKV (arXiv 2604.25975) as kvpress 0.5.5's `CapPress` scores it (read, not copied). Past the
first `n_sink` (4) entries, each query head h weighs entry i by w_i = exp(tau (cos(mu_h, k_i) - max_j cos(mu_h,
k_j))), tau 5: mu_h is the mean of the prompt's queries before RoPE (the sinks' left out) rotated by the RoPE
matrix averaged over the next `n_future_positions` (512) positions, as Expected Attention does, and k_i the
stored key. With A_h = I + sum_i (w_i + epsilon) v_i v_i^T, an entry's score is w_i v_i^T A_h^{-1} v_i (its
weighted leverage among the values, the values standing for the output directions), averaged over the query
heads sharing its KV head; epsilon 1e-6. The sinks take the layer's highest score + 1, so they are always kept.
The query mean comes from the statistics the prefill sums anyway (`query_statistics`), never from the queries
kept one by one. A prompt of at most `n_sink` tokens is all sinks here (kvpress refuses it).

Unlike kvpress, the last `window` (32) tokens are always kept too: kvpress compresses the context alone, our
with-question protocol compresses the question with it; `capkv:window=0` is kvpress's `CapPress` (make
check-references).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.compactor import PromptScorer
from ripplekv.methods.core.base import check_integers, check_positive, register_scorer
from ripplekv.methods.expected_attention import average_rotation
from ripplekv.methods.signals.query_statistics import FIRST_QUERIES, QUERY_STATISTICS


def capacity_scores(state, layer: int, tau: float, n_future_positions: int, n_sink: int, epsilon: float) -> torch.Tensor:
    """CapPress's scores [H_kv, n] of every entry of `layer` (see the module docstring)."""
    keys, values = state.keys[layer].float(), state.values[layer].float()
    kv_heads, length, dim = keys.shape
    if length <= n_sink:
        return keys.new_zeros(kv_heads, length)
    mean, _ = state.signal(QUERY_STATISTICS)[layer].moments(n_sink)  # [H_q, d], before RoPE
    anchor = mean @ average_rotation(state.model, length, n_future_positions, dim, keys.device, layer).T
    group = anchor.shape[0] // kv_heads
    anchor = F.normalize(anchor, dim=-1).view(kv_heads, group, dim)
    rest, spans = keys[:, n_sink:], values[:, n_sink:]  # [H_kv, m, d]
    alignment = torch.einsum("hgd,hmd->hgm", anchor, F.normalize(rest, dim=-1)).clamp(-1.0, 1.0)
    logits = tau * alignment
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))  # [H_kv, group, m]
    columns = spans.transpose(-1, -2)[:, None]  # [H_kv, 1, d, m]
    capacity = torch.eye(dim, device=keys.device) + (columns * (weights + epsilon)[:, :, None]) @ spans[:, None]
    solved = torch.linalg.solve(capacity, columns.expand(-1, group, -1, -1))  # A^{-1} v  [H_kv, group, d, m]
    spread = (columns * solved).sum(-2)  # v^T A^{-1} v  [H_kv, group, m]
    scores = (weights * spread).mean(1)
    return F.pad(scores, (n_sink, 0), value=float(scores.max()) + 1)


@register_scorer("capkv")
@dataclass(frozen=True)
class CapKVScorer(PromptScorer):
    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        check_positive(n_future_positions=self.n_future_positions)
        check_integers({"n_sink": self.n_sink}, minimum=0)
        if self.n_sink > FIRST_QUERIES:
            raise UserError(f"option n_sink must be at most {FIRST_QUERIES}, got {self.n_sink}")
        if not self.epsilon >= 0:
            raise UserError(f"option epsilon must be >= 0, got {self.epsilon!r}")

    def requirements(self) -> Requirements:
        return Requirements(signals={QUERY_STATISTICS})

    def every(self, state, layer):
        options = (self.tau, self.n_future_positions, self.n_sink, self.epsilon)
        return state.memo((capacity_scores, layer, *options), lambda: capacity_scores(state, layer, *options))
