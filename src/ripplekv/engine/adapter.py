"""The one place that touches model internals: embeddings, rotary embedding (and its inverse), decoder
layers, final norm, lm_head, attention scaling, and the checks that a model fits our engine.

Supported families (Llama, Qwen2, Qwen3, Mistral) share this layout in transformers. Our compressed
cache assumes every layer attends to the whole prompt with plain softmax attention, so sliding-window
layers and logit soft-capping are refused here with one clear line rather than computed wrongly.
"""

from __future__ import annotations

import torch

from ripplekv.errors import UserError


def inner(model):
    """The decoder stack (`model.model` in every supported family)."""
    return model.model


def decoder_layers(model):
    return inner(model).layers


def num_layers(model) -> int:
    return int(model.config.num_hidden_layers)


def device(model) -> torch.device:
    return next(model.parameters()).device


def dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def attention_scaling(model) -> float:
    return float(decoder_layers(model)[0].self_attn.scaling)


def embed(model, ids: torch.Tensor) -> torch.Tensor:
    return inner(model).embed_tokens(ids)


def rotary(model, hidden: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) for `positions`, as the decoder layers take them."""
    return inner(model).rotary_emb(hidden, position_ids=positions)


def logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and lm_head, in float32."""
    return model.lm_head(inner(model).norm(hidden)).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_at(model, positions: torch.Tensor, like: torch.Tensor):
    """(cos, sin) [.., len, d] in float32 for integer `positions` [len] (any shape broadcasting over heads)."""
    flat = positions.reshape(1, -1).to(like.device)
    cos, sin = rotary(model, like.float(), flat)
    return cos[0].float().reshape(*positions.shape, -1), sin[0].float().reshape(*positions.shape, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [.., d] to the positions cos/sin stand for (the model's own RoPE)."""
    return x * cos + _rotate_half(x) * sin


def rope_scale(model) -> float:
    """The rotary's `attention_scaling`: long-context RoPE (YaRN, longrope) multiplies cos and sin by it."""
    return float(getattr(inner(model).rotary_emb, "attention_scaling", 1.0))


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Undo `apply_rope` at the same positions: the key as it was before rotation (position 0).

    `cos`/`sin` as the model made them, scaled by `scale` (`rope_scale`): rotating back with them multiplies
    by scale^2, which is divided out (scale 1: the plain rotation, untouched).
    """
    plain = x * cos - _rotate_half(x) * sin
    return plain if scale == 1.0 else plain / (scale * scale)


def check_supported(config) -> None:
    """Refuse what our attention would compute wrongly: logit soft-capping."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            raise UserError(
                f"model type {config.model_type!r} uses {name}; ripplekv's attention does not implement "
                "soft-capping, so its results would be wrong: use a model without it"
            )


def sliding_window(config) -> int | None:
    """The attention window a model's layers are limited to, or None when they see the whole context."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_length(config, prompt_tokens: int, answer_tokens: int = 0, fits: int | None = None) -> None:
    """A prompt plus its answer must fit the model's positions and attention window (ours has no sliding window).

    Mistral-7B-v0.1's config carries `sliding_window=4096`: within 4096 tokens sliding and full attention
    are the same thing, so such prompts run; a 7.5k prompt is refused, with the fix in the message. Beyond
    `max_position_embeddings` the model's RoPE was never trained: refused too, naming the prompt length
    (the `max_length` setting) that leaves room for the answer (`fits` when the caller measured it through its prompt template).
    """
    total_tokens = prompt_tokens + answer_tokens
    window = sliding_window(config)
    if window is not None and total_tokens >= window:  # its sliding cache keeps window - 1 prefilled entries
        raise UserError(
            f"prompt plus answer is {total_tokens} tokens but this model attends only to its last {window} "
            f"(sliding_window={window}); ripplekv computes full attention, so pass {{max_length}} "
            f"{max(1, window - 256)} or less", "max_length"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions and total_tokens > positions:
        raise UserError(
            f"prompt plus answer is {total_tokens} tokens ({prompt_tokens} + {answer_tokens}) but this model has "
            f"max_position_embeddings={positions}: pass {{max_length}} {fits or max(1, positions - answer_tokens)} "
            "or less", "max_length"
        )


def output_projection(model, layer: int) -> torch.Tensor:
    """The attention output projection W_o of `layer` as [H_q, d, hidden] (float32): head h's value
    vector v contributes v @ W_o[h] to the layer's output."""
    attention = decoder_layers(model)[layer].self_attn
    weight = attention.o_proj.weight.detach().float()  # [hidden, H_q * d]
    heads = int(model.config.num_attention_heads)
    return weight.T.reshape(heads, weight.shape[1] // heads, weight.shape[0])
