"""Expected Attention: the attention future queries are expected to pay, from the prompt's query statistics.

Our reading of kvpress's ExpectedAttentionPress (Devoto et al., 2025; read, not copied). Treat the
queries to come as Gaussian with the mean mu and covariance S of the prompt's queries before RoPE (the
first `n_sink` left out), rotated by the RoPE matrix averaged over the next `n_future_positions`
positions (R: mu' = R mu, S' = R S R^T). For a Gaussian query, E[exp(q.k/sqrt d)] =
exp(mu'.k/sqrt d + k^T S' k / (2d)); a softmax of these logits over the prompt's entries (past the sinks),
averaged over the query heads sharing a KV head, times the value norm ||v||_2 (+ epsilon first), is the
score. It needs no question, so it is question-agnostic. The statistics are summed during the one prefill
(the `query_statistics` signal, `methods.signals.query_statistics`), never stored per query. Defaults follow kvpress:
n_future_positions 512, n_sink 4 (kept always), use_covariance and use_vnorm on, epsilon 0. Unlike kvpress,
the last `window` tokens (32) are kept too: kvpress compresses the context alone, our with-question protocol
compresses the question with it; `expected-attention:window=0` is kvpress's `ExpectedAttentionPress` (make
check-references).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import adapter
from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_integers, check_positive, register_scorer
from ripplekv.methods.signals.query_statistics import FIRST_QUERIES, QUERY_STATISTICS
from ripplekv.methods.snapkv import WindowScorer


def average_rotation(model, start: int, count: int, dim: int, device, layer: int | None = None) -> torch.Tensor:
    """The RoPE rotation matrix [d, d] averaged over positions start..start+count-1 (float32), as `layer` rotates."""
    cos, sin = adapter.rope_at(model, torch.arange(start, start + count), torch.zeros(1, device=device), layer)
    half = dim // 2
    swap = torch.zeros(dim, dim, device=device)  # rotate_half as a matrix: x -> (-x[half:], x[:half])
    swap[:half, half:] = -torch.eye(half, device=device)
    swap[half:, :half] = torch.eye(half, device=device)
    return torch.diag(cos.mean(0).to(device)) + torch.diag(sin.mean(0).to(device)) @ swap


@register_scorer("expected-attention")
@dataclass(frozen=True)
class ExpectedAttentionScorer(WindowScorer):
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: int = 1
    use_vnorm: int = 1
    epsilon: float = 0.0

    def __post_init__(self):
        check_positive(n_future_positions=self.n_future_positions)
        check_integers({"n_sink": self.n_sink, "window": self.window}, minimum=0)
        if self.n_sink > FIRST_QUERIES:
            raise UserError(f"option n_sink must be at most {FIRST_QUERIES}, got {self.n_sink}")
        for name in ("use_covariance", "use_vnorm"):
            if getattr(self, name) not in (0, 1):
                raise UserError(f"option {name} must be 0 or 1, got {getattr(self, name)!r}")
        if not self.epsilon >= 0:
            raise UserError(f"option epsilon must be >= 0, got {self.epsilon!r}")

    def floor(self) -> int:
        return max(self.window, 1)

    def requirements(self) -> Requirements:
        return super().requirements().union(Requirements(signals={QUERY_STATISTICS}))

    def expected(self, state, layer) -> torch.Tensor:
        """Scores [H_kv, n] of every entry (the sinks get the layer's highest score + 1)."""
        options = (self.n_future_positions, self.n_sink, self.use_covariance, self.use_vnorm, self.epsilon)
        return state.memo((expected_scores, layer, *options), lambda: expected_scores(state, layer, *options))

    def scores(self, state, layer):
        return self.expected(state, layer)[:, : state.length - min(self.window, state.length)]


def expected_scores(state, layer: int, n_future_positions: int, n_sink: int, use_covariance: int, use_vnorm: int,
                    epsilon: float) -> torch.Tensor:
    """Expected Attention's scores [H_kv, n] of every entry of `layer` (see the module docstring)."""
    keys = state.keys[layer].float()
    kv_heads, length, dim = keys.shape
    sinks = min(n_sink, length - 1)
    mean, cov = state.signal(QUERY_STATISTICS)[layer].moments(n_sink)  # [H_q, d], [H_q, d, d]
    rotation = average_rotation(state.model, length, n_future_positions, dim, keys.device, layer)
    mean = mean @ rotation.T
    group = mean.shape[0] // kv_heads
    rest = keys[:, sinks:]  # [H_kv, m, d]
    logits = torch.einsum("hgd,hmd->hgm", mean.view(kv_heads, group, dim), rest) * state.scaling
    if use_covariance:
        cov = (rotation @ cov @ rotation.T).view(kv_heads, group, dim, dim)
        spread = (torch.matmul(rest[:, None], cov) * rest[:, None]).sum(-1)  # k^T S' k  [H_kv, group, m]
        logits = logits + spread * state.scaling**2 / 2
    scores = torch.softmax(logits, dim=-1).mean(1)
    if use_vnorm:
        scores = (scores + epsilon) * state.values[layer][:, sinks:].float().norm(dim=-1)
    top = scores.max() + 1
    return torch.cat([top.expand(kv_heads, sinks), scores], dim=1)


@register_scorer("lukv")
@dataclass(frozen=True)
class LUKVScorer(ExpectedAttentionScorer):
    """LU-KV's default scorer (and kvpress LUKVPress's): Expected Attention with epsilon 0.02, its 4 sinks and a
    window of 1 kept."""

    window: int = 1
    epsilon: float = 0.02
