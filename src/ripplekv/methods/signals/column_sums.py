"""Each key's attention summed over every prompt query (H2O's heavy hitters), beside the prefill's own attention.

The signal `COLUMN_SUMS` (per layer [H_kv, n] float32), recorded by `ColumnSums` for the methods that
declare it: H2O's scorer and its decoding policy (`methods.core.decoding.Accumulated`).

H2O ranks entries by the attention they received from all prompt queries: the column sums of the n x n
attention map. That map is never built: queries go in chunks, each chunk attends only to the keys it can
see (causal), and the softmax weights of a chunk are summed into the column totals. This is a pass of its
own (`ColumnSums`): the layer's output stays the stock sdpa kernel's, so a run with H2O
prefills exactly as one without. Scores and softmax are float32 whatever the model dtype.

Speed: the work goes one KV head at a time in chunks of QUERY_ROWS queries (times the head's group),
with one reused score buffer, the softmax written in place and the column sums taken as a matrix-vector
product; a chunk's scores then stay in the CPU's cache between the softmax and the sums. (When this pass
also computed the layer's output it measured 1.74x torch 2.13's sdpa on one 3.5k-token layer of the
bundled model's shape; it now skips the value product, and sdpa runs beside it.)
Chunks of 128 or 256 queries gain under 10% and change the sums' rounding, so they stay at 64.
"""

from __future__ import annotations

import torch

from ripplekv.engine.recorders import PerLayer, register_recorder

COLUMN_SUMS = "accumulated_attention"
# Queries per chunk and KV head (the chunk holds QUERY_ROWS x group query rows).
QUERY_ROWS = 64
# Upper bound on a chunk's score elements, so memory stays bounded at any length and group size.
CHUNK_ELEMENTS = 1 << 22


def chunk_rows(group: int, length: int) -> int:
    """Queries per chunk: QUERY_ROWS, fewer when the chunk's scores would exceed CHUNK_ELEMENTS."""
    return max(1, min(length, QUERY_ROWS, CHUNK_ELEMENTS // max(1, group * length)))


def column_sums(query, key, scaling: float, attention_mask=None) -> torch.Tensor:
    """Each key's accumulated attention in a causal prompt: [H_kv, n] float32.

    `query` [1, H_q, n, d], `key` [1, H_kv, n, d] (grouped heads share a KV head): for each key, the
    attention all n queries give it, averaged over the query heads that share its KV head.
    `attention_mask` (bool: True = visible, or additive float), when given, is applied on top of causality.
    """
    query_heads, length, dim = query.shape[1:]
    kv_heads = key.shape[1]
    group = query_heads // kv_heads
    queries = (query[0].float() * scaling).view(kv_heads, group, length, dim)
    keys_t = key[0].float().transpose(-1, -2)
    columns = torch.zeros(kv_heads, length, dtype=torch.float32, device=query.device)
    step = chunk_rows(group, length)
    buffer = torch.empty(group * step * length, dtype=torch.float32, device=query.device)
    ones = torch.ones(group * step, dtype=torch.float32, device=query.device)
    for start in range(0, length, step):
        stop = min(length, start + step)
        rows = stop - start
        # Queries start..stop-1 see keys 0..stop-1 at most; later keys are skipped, not masked.
        ahead = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)
        extra = None if attention_mask is None else attention_mask[0, :, start:stop, :stop]
        if extra is not None and extra.shape[0] > 1:  # one mask per query head
            extra = extra.view(kv_heads, group, rows, stop)
        for head in range(kv_heads):
            scores = buffer[: group * rows * stop].view(group * rows, stop)
            torch.matmul(queries[head, :, start:stop].reshape(group * rows, dim), keys_t[head, :, :stop], out=scores)
            blocks = scores.view(group, rows, stop)
            blocks[..., start:stop].masked_fill_(ahead, float("-inf"))
            if extra is not None:
                visible = extra[head] if extra.dim() == 4 else extra
                if visible.dtype == torch.bool:
                    blocks.masked_fill_(~visible, float("-inf"))
                else:
                    blocks.add_(visible.float())
            torch.softmax(scores, dim=-1, out=scores)
            columns[head, :stop].addmv_(scores.T, ones[: group * rows])
    return columns / group


@register_recorder(COLUMN_SUMS)
class ColumnSums(PerLayer):
    """Each key's attention summed over every prompt query [H_kv, n] float32 (H2O), in a pass of its own."""

    def layer(self, index, query, key, value, attention_mask, scaling):
        self.layers[index] = column_sums(query, key, scaling, attention_mask)
