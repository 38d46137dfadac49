"""Statistics of every prompt query before RoPE, summed during the prefill (Expected Attention needs them).

The prefill's attention sees each query after RoPE at its own position; undoing the rotation gives the
query the model's projection made, whose mean and covariance over the prompt describe the queries to
come. Only sums are kept (d x d per query head), never the n queries: the signal `QUERY_STATISTICS`
(per layer a `QueryStatistics`), recorded by `QueryMoments` for the methods that declare it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import adapter
from ripplekv.engine.recorders import PerLayer, register_recorder

QUERY_STATISTICS = "query_statistics"

# The first prompt queries are also kept one by one, so a scorer can leave its sink tokens out of the statistics.
FIRST_QUERIES = 16


@dataclass
class QueryStatistics:
    """Sums over a layer's prompt queries before RoPE, per query head (float32), never the queries themselves."""

    count: int
    total: torch.Tensor  # [H_q, d]: sum of q
    outer: torch.Tensor  # [H_q, d, d]: sum of q q^T
    first: torch.Tensor  # [H_q, min(n, FIRST_QUERIES), d]: the first queries, to subtract sinks

    def moments(self, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [H_q, d], covariance [H_q, d, d], biased) of the queries from position `skip` on."""
        skip = min(skip, self.first.shape[1], self.count - 1)
        head = self.first[:, :skip]
        count = self.count - skip
        mean = (self.total - head.sum(1)) / count
        second = (self.outer - torch.einsum("hni,hnj->hij", head, head)) / count
        return mean, second - mean[:, :, None] * mean[:, None, :]


def query_statistics(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> QueryStatistics:
    """Statistics of one layer's prompt queries [H_q, n, d] (post-RoPE, as attention sees them) before RoPE
    (`scale`: the rotary's attention_scaling, `adapter.rope_scale`)."""
    plain = adapter.invert_rope(queries.float(), cos, sin, scale)
    return QueryStatistics(count=int(plain.shape[1]), total=plain.sum(1), outer=torch.einsum("hni,hnj->hij", plain, plain),
                           first=plain[:, :FIRST_QUERIES].clone())


@register_recorder(QUERY_STATISTICS)
class QueryMoments(PerLayer):
    """Sums of every prompt query before RoPE (`QueryStatistics`, Expected Attention)."""

    def __init__(self, setup):
        super().__init__(setup)
        self.ropes: dict = {}  # (cos, sin, scale) by the layer's RoPE (Gemma 3's differ by layer type)

    def layer(self, index, query, key, value, attention_mask, scaling):
        model = self.setup.model
        kind = adapter.rope_kind(model, index)
        if kind not in self.ropes:
            probe = torch.zeros(1, device=adapter.device(model), dtype=adapter.dtype(model))
            cos, sin = adapter.rope_at(model, torch.arange(self.setup.length), probe, index)
            self.ropes[kind] = (cos, sin, adapter.rope_scale(model, index))
        self.layers[index] = query_statistics(query[0], *self.ropes[kind])
