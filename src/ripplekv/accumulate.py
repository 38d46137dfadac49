"""Prefill attention that also sums the attention every prompt query gives each key (H2O's heavy hitters).

H2O ranks entries by the attention they received from all prompt queries: the column sums of the n x n
attention map. That map is never built: queries go in chunks, each chunk attends only to the keys it can
see (causal), and the softmax weights of a chunk are both summed into the column totals and multiplied
by the values, so the one prefill computes the layer's output and the totals together. Scores and
softmax are float32 whatever the model dtype. Only prefills that ask for it (`prefill(accumulate=True)`)
take this path; every other prefill keeps the stock sdpa kernel.
"""

from __future__ import annotations

import torch

# Score elements per chunk (16 MB of float32): bounds memory at any length and keeps a chunk's scores
# small enough to be reused from cache by the softmax, the column sums and the value product.
CHUNK_ELEMENTS = 1 << 22


def chunk_rows(query_heads: int, length: int) -> int:
    """Queries per chunk so that a chunk's scores hold at most CHUNK_ELEMENTS values."""
    return max(1, min(length, CHUNK_ELEMENTS // max(1, query_heads * length)))


def attention_with_column_sums(query, key, value, scaling: float, attention_mask=None):
    """Causal attention of one prompt plus each key's accumulated attention.

    `query` [1, H_q, n, d], `key`/`value` [1, H_kv, n, d] (grouped heads share a KV head). Returns the
    attention output [1, n, H_q, d] (the layout transformers' attention functions return) and the
    column sums [H_kv, n] in float32: for each key, the attention all n queries give it, averaged over
    the query heads that share its KV head. `attention_mask` (bool: True = visible, or additive float),
    when given, is applied on top of causality.
    """
    q, k, v = query[0], key[0], value[0]
    query_heads, length, dim = q.shape
    kv_heads = k.shape[0]
    group = query_heads // kv_heads
    grouped = q.view(kv_heads, group, length, dim)
    out = torch.empty(kv_heads, group, length, v.shape[-1], dtype=v.dtype, device=v.device)
    columns = torch.zeros(kv_heads, length, dtype=torch.float32, device=q.device)
    step = chunk_rows(query_heads, length)
    for start in range(0, length, step):
        stop = min(length, start + step)
        rows = stop - start
        # Queries start..stop-1 see keys 0..stop-1 at most; later keys are skipped, not masked.
        scores = torch.matmul(grouped[:, :, start:stop].reshape(kv_heads, group * rows, dim), k[:, :stop].transpose(-1, -2))
        scores = scores.float().mul_(scaling).view(kv_heads, group, rows, stop)
        # Only the chunk's diagonal block holds keys after a query.
        ahead = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., start:stop].masked_fill_(ahead, float("-inf"))
        if attention_mask is not None:
            extra = attention_mask[0, :, start:stop, :stop]
            scores = scores.masked_fill(~extra, float("-inf")) if extra.dtype == torch.bool else scores + extra.float()
        weights = torch.softmax(scores, dim=-1)
        columns[:, :stop] += weights.sum(dim=(1, 2))
        mixed = torch.matmul(weights.view(kv_heads, group * rows, stop).to(v.dtype), v[:, :stop])
        out[:, :, start:stop] = mixed.view(kv_heads, group, rows, -1)
    output = out.view(1, query_heads, length, -1).transpose(1, 2).contiguous()
    return output, columns / group
