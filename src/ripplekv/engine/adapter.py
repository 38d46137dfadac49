"""The one place that touches model internals: embeddings, rotary embedding (and its inverse), decoder
layers, final norm, lm_head, attention scaling, and the checks that a model fits our engine.

Supported families (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3) share this layout in transformers.
Layers may differ in what they attend to (`layer_windows`: Gemma's sliding-window layers beside global
ones) and, in Gemma 3, in their RoPE (`rotary(..., layer=)`). Logit soft-capping is refused here with one
clear line rather than computed wrongly, and so is a prompt longer than the window of a model whose every
layer slides (no layer would read it).
"""

from __future__ import annotations

import inspect

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


def rope_kind(model, layer: int | None) -> str | None:
    """The rotary's key for `layer` where RoPE differs by layer type (Gemma 3: local and global bases), else
    None (one RoPE for every layer: `layer` may then be None)."""
    rotary_emb = inner(model).rotary_emb
    if "layer_type" not in inspect.signature(rotary_emb.forward).parameters:
        return None
    if layer is None:
        raise ValueError("this model's RoPE differs by layer: pass the layer")
    return model.config.layer_types[layer]


def rotary(model, hidden: torch.Tensor, positions: torch.Tensor, layer: int | None = None):
    """(cos, sin) for `positions`, as decoder layer `layer` takes them (the same for every layer but in Gemma 3)."""
    kind = rope_kind(model, layer)
    if kind is None:
        return inner(model).rotary_emb(hidden, position_ids=positions)
    return inner(model).rotary_emb(hidden, positions, kind)


def rotary_by_layer(model, hidden: torch.Tensor, positions: torch.Tensor) -> list:
    """(cos, sin) for every decoder layer, computed once per distinct RoPE."""
    made: dict = {}
    for layer in range(num_layers(model)):
        kind = rope_kind(model, layer)
        if kind not in made:
            made[kind] = rotary(model, hidden, positions, layer)
    return [made[rope_kind(model, layer)] for layer in range(num_layers(model))]


def logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and lm_head, in float32."""
    return model.lm_head(inner(model).norm(hidden)).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_at(model, positions: torch.Tensor, like: torch.Tensor, layer: int | None = None):
    """(cos, sin) [.., len, d] in float32 for integer `positions` [len] (any shape broadcasting over heads),
    as layer `layer` rotates (needed where RoPE differs by layer: Gemma 3)."""
    flat = positions.reshape(1, -1).to(like.device)
    cos, sin = rotary(model, like.float(), flat, layer)
    return cos[0].float().reshape(*positions.shape, -1), sin[0].float().reshape(*positions.shape, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [.., d] to the positions cos/sin stand for (the model's own RoPE)."""
    return x * cos + _rotate_half(x) * sin


def rope_scale(model, layer: int | None = None) -> float:
    """The rotary's `attention_scaling`: long-context RoPE (YaRN, longrope) multiplies cos and sin by it."""
    kind = rope_kind(model, layer)
    name = "attention_scaling" if kind is None else f"{kind}_attention_scaling"
    return float(getattr(inner(model).rotary_emb, name, 1.0))


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


def layer_windows(config) -> list[int | None]:
    """Per layer, the attention window it is limited to (its last W positions, itself included), or None for a
    layer that sees the whole context. From `layer_types` where the config has them (Gemma 2/3, Qwen2 with
    `use_sliding_window`), else one window for every layer (Mistral's `sliding_window`)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [int(window)] * layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def layer_capacities(n: int, windows) -> list[int]:
    """What each layer can hold of an n-token prompt: all of it, or on a sliding-window layer of window W its
    last W - 1 tokens (what the model's own sliding cache keeps: the next token's query is the W-th)."""
    return [n if window is None else min(n, max(int(window) - 1, 1)) for window in windows]


def has_sliding_layers(config) -> bool:
    """Whether some layer of the model attends only to a window of the context."""
    return any(window is not None for window in layer_windows(config))


def sliding_window(config) -> int | None:
    """The window every layer of a model is limited to, or None when some layer sees the whole context. A
    hybrid model (sliding and global layers) reads any prompt through its global layers: None."""
    windows = layer_windows(config)
    if not windows or any(window is None for window in windows):
        return None
    return min(windows)


def check_length(config, prompt_tokens: int, answer_tokens: int = 0, fits: int | None = None) -> None:
    """A prompt plus its answer must fit the model's positions and, when every layer slides, its window.

    Mistral-7B-v0.1's config carries `sliding_window=4096` on every layer: within 4096 tokens sliding and full
    attention are the same thing, so such prompts run; a 7.5k prompt is refused, with the fix in the message
    (no layer would read its start). A hybrid model (Gemma) takes any length its positions allow. Beyond
    `max_position_embeddings` the model's RoPE was never trained: refused too, naming the prompt length (the
    `max_length` setting) that leaves room for the answer (`fits` when the caller measured it through its
    prompt template).
    """
    total_tokens = prompt_tokens + answer_tokens
    window = sliding_window(config)
    if window is not None and total_tokens >= window:  # its sliding cache keeps window - 1 prefilled entries
        raise UserError(
            f"prompt plus answer is {total_tokens} tokens but this model attends only to its last {window} "
            f"(sliding_window={window}) in every layer, so no layer reads the prompt's start: pass {{max_length}} "
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
    heads = int(model.config.num_attention_heads)  # a loaded model's own (text) config
    return weight.T.reshape(heads, weight.shape[1] // heads, weight.shape[0])
