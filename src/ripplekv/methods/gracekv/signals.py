"""GraceKV's per-token relevance and per-head weights (the published form).

Relevance R of a compressible token, per (layer, KV head): the probe queries' attention to it (the last
`window` prompt queries, summed over queries and averaged over the query heads of the KV head: the prompt's
question suffix and sequence suffix, which our templates put at the end) plus `mix` x relevance propagated
from seed tokens. Propagation: the `seeds` most relevant tokens pass their relevance to every token in
proportion to softmax(k_s . k_j x scaling) over their un-rotated keys, so a token whose key resembles a
seed's (and would draw the queries that draw the seed) gains relevance; `hops` rounds, seeds re-picked from
what the last round propagated. The paper also probes with queries of high-evidence slots; the prefill keeps
queries of the window only, so propagation from the seeds stands in for them (our reading, said here).

Head weight omega of (layer, KV head): ||W_o|| over the head's query heads (Frobenius) x the mean norm of the
head's attention output on the probe queries, divided by the mean over all (layer, head); every gain of the
head is scaled by it.
"""

from __future__ import annotations

import torch

from ripplekv.engine import adapter
from ripplekv.engine.prefill import PrefillState
from ripplekv.methods.snapkv import window_attention


def propagate(relevance: torch.Tensor, unrotated: torch.Tensor, scaling: float, seeds: int) -> torch.Tensor:
    """One round: the top `seeds` tokens of `relevance` [H, P] pass it on by key similarity ([H, P, d] keys)."""
    count = min(seeds, relevance.shape[1])
    top = torch.topk(relevance, count, dim=-1)  # ties: torch.topk is deterministic for one input
    seed_keys = unrotated.gather(1, top.indices[..., None].expand(-1, -1, unrotated.shape[-1]))  # [H, s, d]
    share = torch.softmax(torch.matmul(seed_keys, unrotated.transpose(-1, -2)) * scaling, dim=-1)  # [H, s, P]
    return (top.values[..., None] * share).sum(1)


def layer_signals(state: PrefillState, layer: int, sinks: int, window: int, opts, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """(R [H_kv, n_c] relevance of the compressible tokens, omega_raw [H_kv]) for one layer."""
    n = state.length
    attention = window_attention(state, layer, window, "GraceKV")  # [H, g, w, n]
    direct = attention.sum(2).mean(1)[:, sinks : n - window]  # [H, n_c]
    keys = state.keys[layer].float()
    unrotated = adapter.invert_rope(keys, rope.cos[:n], rope.sin[:n])[:, sinks : n - window]
    relevance, spread = direct, direct
    for _ in range(opts.hops):
        spread = propagate(spread, unrotated, state.scaling, opts.seeds)
        relevance = relevance + opts.mix * spread
    outputs = torch.matmul(attention, state.values[layer].float()[:, None])  # [H, g, w, d]
    weight = adapter.output_projection(state.model, layer).to(state.device)  # [H_q, d, hidden]
    heads = keys.shape[0]
    w_norm = weight.reshape(heads, -1, weight.shape[-1]).square().sum((1, 2)).sqrt()  # over the group's query heads
    return relevance, w_norm * outputs.norm(dim=-1).mean((1, 2))


def signals(state: PrefillState, sinks: int, window: int, opts, rope) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([R per layer], omega [L, H_kv] normalised to mean 1), cached per prompt."""
    def compute():
        per_layer = [layer_signals(state, layer, sinks, window, opts, rope) for layer in range(state.num_layers)]
        omega = torch.stack([raw for _, raw in per_layer])
        return [relevance for relevance, _ in per_layer], omega / omega.mean().clamp(min=1e-30)

    return state.memo((signals, sinks, window, opts.mix, opts.seeds, opts.hops), compute)
