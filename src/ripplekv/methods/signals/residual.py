"""How much each layer's attention turns the residual stream, measured on the last prompt tokens.

SqueezeAttention sizes layers by the cosine similarity between the residual stream before and after each
layer's self-attention. The prefill keeps no hidden states, so this recomputes them for the last `tokens`
prompt tokens only: those tokens are fed again at their own positions through a plain cache holding the
prompt's K/V before them, which reproduces their prefill hidden states (up to kernel rounding) at a cost
of `tokens` rows of attention and MLP, not a second prefill. Hooks read each decoder layer's input and
its attention's output; nothing of the model changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ripplekv.engine import adapter
from ripplekv.engine.cache import install
from ripplekv.engine.prefill import PrefillState


@torch.inference_mode()
def residual_cosines(model, state: PrefillState, tokens: int) -> torch.Tensor:
    """[L] float32: for each layer, cos(h, h + attention(h)) averaged over the last `tokens` prompt tokens,
    h being the residual stream entering the layer."""
    count = max(1, min(tokens, state.length))
    start = state.length - count
    install(model)
    cache = DynamicCache()
    if start > 0:
        for layer in range(state.num_layers):
            cache.update(state.keys[layer][None, :, :start], state.values[layer][None, :, :start], layer)
    before: dict[int, torch.Tensor] = {}
    cosines = torch.zeros(state.num_layers, dtype=torch.float32, device=state.device)
    handles = []
    for index, decoder in enumerate(adapter.decoder_layers(model)):
        def enter(module, args, kwargs, index=index):
            before[index] = (args[0] if args else kwargs["hidden_states"]).float()

        def attended(module, args, output, index=index):
            change = (output[0] if isinstance(output, tuple) else output).float()
            cosines[index] = F.cosine_similarity(before[index], before[index] + change, dim=-1).mean()

        handles.append(decoder.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(decoder.self_attn.register_forward_hook(attended))
    try:
        ids = state.input_ids[start:][None]
        positions = torch.arange(start, state.length, device=ids.device)[None]
        model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return cosines
