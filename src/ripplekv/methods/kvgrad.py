"""KVgrad: KVzip's reconstruction pass, each entry weighted by how much the model's output depends on what it writes.

Our reading of KVgrad (openreview cg1wTCJjjk) and of kvpress's KVgradPress (read, not copied). The context is
replayed as KVzip replays it ("Repeat the previous context exactly.", chunk by chunk, through the full cache;
`methods.kvzip`). For a replay token p, an entry c of layer l and a query head h of c's KV head:

    score(l, c) = max over p and h of  A_{p,c} x ||v_c W_O^h||_2 x ||d Phi / d a_p^l||_2

A is the replay queries' attention over the sinks, the chunk and the replay tokens (KVzip's softmax), v_c W_O^h
what the entry writes into the residual stream through head h's slice of the output projection, and a_p^l the
attention output of layer l at token p, whose gradient says how much Phi = sum_p ||h_p^L||^2 (the last decoder
layer's output before the final norm, squared) relies on it. The first `n_sink` (4) entries score above every
other. Defaults follow kvpress: chunks of 512 context tokens, n_sink 4, all layers and heads competing (the
`global` allocator). As for `kvzip`, the last `window` (32) tokens are always kept, the pass replays from the
prompt's start, and a layer's total is a multiple of H_kv; `kvgrad:granularity=entry:skip_template=1:window=0`
is kvpress's press (make check-references).

The pass: per chunk one forward through the model with autograd on (the prompt's K/V constants, the model's
own sdpa attention), then one backward from Phi to every layer's attention output (`torch.autograd.grad`: no
parameter gradient is formed, the model is unchanged), in the model's dtype with Phi and the scores in float32
(the CPU runs float32). Memory is bounded by the chunk: the graph holds one chunk's activations (~530 tokens) and
its attention over the prompt, not the prompt's; the scores then come from each layer's replay queries in blocks
of 128 rows (`continuation.causal_attention_rows`), no map over the whole prompt. The prompt's K/V is read per
layer as the replay attends (transformers' sdpa, which copies it to the query heads). Its cost is its own phase in
`engine.timings` (`GRADIENT_PASS`); scripts/bench_replay_passes.py prints it in prefills beside KVzip's pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ripplekv.engine import adapter, timings
from ripplekv.engine.cache import install
from ripplekv.engine.malloc import keeping_freed_memory
from ripplekv.errors import UserError
from ripplekv.methods.core.base import register_scorer
from ripplekv.methods.kvzip import KVzipScorer, replay_chunks
from ripplekv.methods.signals.continuation import Handing, causal_attention_rows

GRADIENT_PASS = "kvgrad gradient pass"  # the pass's phase in `engine.timings` (within its method's build)


def gradient_scores(state, n_sink: int, chunk: int, skip_template: int = 0) -> torch.Tensor:
    """Scores [L, H_kv, n] of every prompt entry by the replay and its backward pass (once per prefill and options)."""
    return state.memo((replay_with_gradients, n_sink, chunk, skip_template),
                      lambda: replay_with_gradients(state, n_sink, chunk, skip_template))


def replay_with_gradients(state, n_sink: int, chunk: int, skip_template: int = 0) -> torch.Tensor:
    if state.model is None:
        raise UserError("kvgrad needs the model for its replay and backward pass: prefill with the model")
    with timings.phase(GRADIENT_PASS), torch.inference_mode(False), keeping_freed_memory():
        length = len(state.input_ids)
        scores = torch.zeros(state.num_layers, state.num_kv_heads, length, dtype=torch.float32, device=state.device)
        for tokens, start, stop in replay_chunks(state, chunk, skip_template):
            score_chunk(state, tokens, scores, min(n_sink, start), start, stop)
        scores[..., :n_sink] = scores.max() + 1.0
    return scores


def replay(state, tokens: list[int]) -> tuple[dict, list[torch.Tensor]]:
    """One forward of `tokens` after the prompt with autograd on, and the backward from Phi: ({layer: (queries
    [H_q, T, d], new keys [H_kv, T, d])}, per layer ||d Phi / d a_p|| [T] float32)."""
    model, length = state.model, state.length
    install(model)
    cache = DynamicCache()  # the prompt's K/V as constants: no gradient flows into them
    for layer in range(state.num_layers):
        cache.update(state.keys[layer][None], state.values[layer][None], layer)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    outputs: dict[int, torch.Tensor] = {}
    last: list[torch.Tensor] = []

    def keep_queries(layer, query, key):
        seen[layer] = (query[0].detach(), key[0, :, length:].detach())

    def keep_output(index):
        def hook(module, args, output):
            outputs[index] = output[0] if isinstance(output, tuple) else output
        return hook

    layers = adapter.decoder_layers(model)
    handles = [layer.self_attn.register_forward_hook(keep_output(index)) for index, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(lambda module, args, output: last.append(
        output[0] if isinstance(output, tuple) else output)))
    try:
        with torch.enable_grad():
            ids = torch.as_tensor(tokens, dtype=torch.long, device=state.device)[None]
            embedded = adapter.embed(model, ids).detach().requires_grad_(True)
            positions = torch.arange(length, length + ids.shape[1], device=ids.device)[None]
            model(inputs_embeds=embedded, position_ids=positions, cache=cache, use_cache=True,
                  ripplekv_recorders=[Handing(keep_queries)], logits_to_keep=1)
            objective = last[-1].float().square().sum()
            grads = torch.autograd.grad(objective, [outputs[index] for index in range(len(layers))])
    finally:
        for handle in handles:
            handle.remove()
    return seen, [grad[0].detach().float().norm(dim=-1) for grad in grads]


def value_output_norms(state, layer: int, start: int, stop: int) -> torch.Tensor:
    """||v_c W_O^h||_2 for the entries [start, stop) of `layer`: [H_kv, group, stop - start] float32."""
    weight = adapter.output_projection(state.model, layer).to(state.device)  # [H_q, d, hidden]
    values = state.values[layer][:, start:stop].float()  # [H_kv, c, d]
    kv_heads, dim = values.shape[0], values.shape[2]
    weight = weight.view(kv_heads, weight.shape[0] // kv_heads, dim, -1)
    rows = 128
    return torch.cat([torch.matmul(values[:, None, at:at + rows], weight).norm(dim=-1)
                      for at in range(0, values.shape[1], rows)], dim=2)


def score_chunk(state, tokens: list[int], scores: torch.Tensor, sink: int, start: int, stop: int) -> None:
    """Raise each entry of [start, stop) in `scores` [L, H_kv, n] to its largest A x ||v W_O|| x ||grad|| over the
    replay of `tokens`."""
    seen, gradient_norms = replay(state, tokens)
    with torch.no_grad():
        for layer in range(state.num_layers):
            queries, new_keys = seen[layer]
            keys = state.keys[layer]
            chunk_keys = torch.cat([keys[:, :sink], keys[:, start:stop]], dim=1)
            norms = value_output_norms(state, layer, start, stop)[:, :, None, :]  # [H_kv, group, 1, c]
            best = scores[layer, :, start:stop]
            for offset, block in causal_attention_rows(queries, chunk_keys, new_keys, state.scaling):
                weight = gradient_norms[layer][offset:offset + block.shape[2]].view(1, 1, -1, 1)
                torch.maximum(best, (block[..., sink:] * norms * weight).amax(dim=(1, 2)), out=best)


@register_scorer("kvgrad")
@dataclass(frozen=True)
class KVgradScorer(KVzipScorer):
    chunk: int = 512

    def scores(self, state, layer):
        window = min(self.window, state.length)
        return gradient_scores(state, self.n_sink, self.chunk, self.skip_template)[layer, :, : state.length - window]
