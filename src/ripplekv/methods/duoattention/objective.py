"""DuoAttention's gate objective (Xiao et al., arXiv 2410.10819, section 3.1), our implementation.

Every KV head's attention output is mixed as alpha x full attention + (1 - alpha) x streaming attention (the
query sees only the first `sinks` keys and the last `recent` ones, itself included), with one trainable alpha per
(layer, KV head) and the model frozen. The loss is the paper's: the mean over the answer's positions of the
mean squared difference between the last hidden states (the model body's output, after its final norm) of the
mixed model and of the full-attention model, plus `l1` x the mean |alpha| (the L1 penalty that pushes heads
towards streaming). The last hidden states rather than the logits, as the paper and its code distil.
Attention is computed here in float32 (at least) from the n x n scores: the fit runs on short calibration prompts only.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

MIXED = "ripplekv_duoattention_mixed"  # the attention implementation's name while gates are mixed in


def streaming_mask(queries: int, keys: int, sinks: int, recent: int, device=None) -> torch.Tensor:
    """Bool [queries, keys]: what a streaming head's query may see (causal; the first `sinks` keys and the
    `recent` keys up to and including its own position)."""
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    cols = torch.arange(keys, device=device)[None, :]
    return (cols <= rows) & ((cols < sinks) | (rows - cols < recent))


def mixed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: full and streaming attention, mixed per KV head by the module's gates
    (`module.duo_mixing`: the gates [H_kv] of its layer, sinks, recent)."""
    gates, sinks, recent = module.duo_mixing
    groups = query.shape[1] // key.shape[1]
    exact = torch.promote_types(query.dtype, torch.float32)  # float32 at least (float64 in a float64 model)
    key = key.repeat_interleave(groups, dim=1).to(exact)
    value = value.repeat_interleave(groups, dim=1).to(exact)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query.to(exact), key.transpose(-1, -2)) * scale
    queries, keys = scores.shape[-2:]
    stream = streaming_mask(queries, keys, sinks, recent, scores.device)
    causal = streaming_mask(queries, keys, keys, 0, scores.device)  # every earlier key is a sink
    full = torch.matmul(scores.masked_fill(~causal, float("-inf")).softmax(-1), value)
    streaming = torch.matmul(scores.masked_fill(~stream, float("-inf")).softmax(-1), value)
    alpha = gates.repeat_interleave(groups)[None, :, None, None].to(full.dtype)
    mixed = alpha * full + (1 - alpha) * streaming
    return mixed.to(query.dtype).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(MIXED, mixed_attention)


@contextmanager
def gates_mixed_in(model, gates: torch.Tensor, sinks: int, recent: int):
    """Within the block, `model`'s attention mixes full and streaming attention by `gates` [L, H_kv]."""
    from ripplekv.engine import adapter

    _register()
    layers = [layer.self_attn for layer in adapter.decoder_layers(model)]
    before = model.config._attn_implementation
    for index, attention in enumerate(layers):
        attention.duo_mixing = (gates[index], sinks, recent)
    model.set_attn_implementation(MIXED)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
        for attention in layers:
            del attention.duo_mixing


def last_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The model body's last hidden states [n, D] (after its final norm) for one prompt [n]."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return body(input_ids=ids[None], use_cache=False).last_hidden_state[0]


def distill_loss(mixed: torch.Tensor, full: torch.Tensor, answer: int) -> torch.Tensor:
    """Mean over the last `answer` positions of the mean squared difference of the hidden states."""
    diff = mixed[-answer:].float() - full[-answer:].float()
    return diff.pow(2).mean(-1).mean()


def gate_loss(model, ids: torch.Tensor, answer: int, gates: torch.Tensor, sinks: int, recent: int, l1: float,
              full: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss, distillation part) of `gates` on one prompt whose last `answer` tokens are the answer;
    `full`: the full-attention model's last hidden states when already computed."""
    if full is None:
        with torch.no_grad():
            full = last_hidden(model, ids)
    with gates_mixed_in(model, gates, sinks, recent):
        mixed = last_hidden(model, ids)
    distill = distill_loss(mixed, full, answer)
    return distill + l1 * gates.abs().mean(), distill
