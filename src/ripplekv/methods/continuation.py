"""Teacher-forced passes through the full prompt cache that report each layer's new queries and keys.

Some scorers rank prompt entries by how much *later* tokens attend to them: KVzip by the queries of a
"repeat the context" pass, the oracle by the full-cache answer. Both feed tokens after the prompt
through the uncompressed cache; the attention function hands each layer's new queries and keys
(post-RoPE) to a callback, which reduces them at once, so no map over all prompt positions is kept.
The model itself attends with sdpa through a plain transformers cache holding the prompt's keys and
values, as the prefill does: the full cache needs none of our compressed attention's biases, and the
eager float32 attention that would mean cost KVzip's pass over a 3.5k prompt about 4.7 prefills. On a CPU
KVzip's lower-right causal attention is two unmasked flash attentions merged by their log-sum-exps
(`lower_right_attention`): sdpa with the mask costs ~30% more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from ripplekv.engine.cache import install
from ripplekv.engine.prefill import PrefillState
from ripplekv.engine.recorders import Recorder

# callback(layer, queries [H_q, p, d], new_keys [H_kv, T, d]), post-RoPE: the p tokens of this piece and the keys of
# all T tokens fed so far (this piece's last)
Probe = Callable[[int, torch.Tensor, torch.Tensor], None]


class Handing(Recorder):
    """Hands each layer's queries and keys to `callback(layer, query, key)` (a pass's probe, not a signal)."""

    def __init__(self, callback):
        self.callback = callback

    def layer(self, index, query, key, value, attention_mask, scaling):
        self.callback(index, query, key)


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def lower_right_attention(module, query, key, value, mask, scaling):
    """The model's attention for p new queries over n keys whose last p are theirs (causal among themselves,
    everything before visible), as [1, p, H_q, d]. On a CPU: flash attention over the n - p earlier keys
    (no mask) and over the p new ones (causal), merged by their log-sum-exps, equal to sdpa with the mask
    within float tolerance; elsewhere, and on a sliding-window layer, sdpa with the model's mask."""
    if query.device.type != "cpu" or getattr(module, "sliding_window", None) or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)[0]
    length, count = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    own, own_lse = _FLASH_CPU(query, key[:, :, count - length:], value[:, :, count - length:], 0.0, True, scale=scaling)
    if count > length:
        earlier, earlier_lse = _FLASH_CPU(query, key[:, :, :count - length], value[:, :, :count - length], 0.0, False,
                                          scale=scaling)
        top = torch.maximum(own_lse, earlier_lse)
        own_weight, earlier_weight = (own_lse - top).exp_()[..., None], (earlier_lse - top).exp_()[..., None]
        own = ((own * own_weight + earlier * earlier_weight) / (own_weight + earlier_weight)).to(query.dtype)
    return own.transpose(1, 2).contiguous()


# Tokens fed per forward: bounds the attention of a piece over the prompt to PIECE x n scores per head.
PIECE = 512


@torch.inference_mode()
def probe_tokens(model, state: PrefillState, tokens: list[int], callback: Probe, piece: int | None = None,
                 fast: bool = False) -> None:
    """Feed `tokens` right after the whole prompt (positions n, n+1, ...) through the full cache, `piece` at a time
    (the same as one forward: the cache keeps the pieces already fed). `fast`: attend by `lower_right_attention`,
    for a pass as long as the prompt (KVzip's); the oracles' passes of a few dozen answer tokens keep sdpa with the
    mask, bit for bit what results/ were computed with (the merge moves their scores by ~1e-7, enough to swap
    near-tied entries)."""
    if not tokens:
        return
    install(model)
    cache = DynamicCache()  # no config: every layer attends to everything, as our own attention does
    for layer in range(state.num_layers):
        cache.update(state.keys[layer][None], state.values[layer][None], layer)
    ids = torch.as_tensor(tokens, dtype=torch.long, device=state.device)[None]
    piece = piece or PIECE
    # the cache hands attention the prompt's keys followed by the new ones
    probe = [Handing(lambda layer, query, key: callback(layer, query[0], key[0, :, state.length:]))]
    for start in range(0, ids.shape[1], piece):
        chunk = ids[:, start:start + piece]
        positions = torch.arange(state.length + start, state.length + start + chunk.shape[1], device=ids.device)[None]
        model(input_ids=chunk, position_ids=positions, cache=cache, use_cache=True, ripplekv_recorders=probe,
              ripplekv_attend=lower_right_attention if fast else None, logits_to_keep=1)


def causal_attention_rows(queries: torch.Tensor, prompt_keys: torch.Tensor, new_keys: torch.Tensor, scaling: float,
                          rows: int = 128):
    """Yield (index, attention [H_kv, group, r, K]) in blocks of `rows` queries, float32: the queries are the last
    p of the T new tokens (`index` is the block's first among all T), attending over the prompt keys
    `prompt_keys` [H_kv, K, d] (all visible) and the new tokens' keys [H_kv, T, d] (causal); each block keeps
    only the prompt part (its rows still sum to 1 with the new keys included). Blocks of 128 rows keep the
    logits in a CPU's cache between the product, the softmax and the caller's reduction: KVzip's pass took
    ~20% less than with 256, with the same scores to the bit."""
    kv_heads, count = prompt_keys.shape[0], prompt_keys.shape[1]
    group = queries.shape[0] // kv_heads
    length = queries.shape[1]
    offset = new_keys.shape[1] - length  # new-token index of the first query
    grouped = queries.float().view(kv_heads, group, length, -1) * scaling
    keys = torch.cat([prompt_keys.float(), new_keys.float()], dim=1)  # [H_kv, K + T, d]
    for start in range(0, length, rows):
        stop = min(length, start + rows)
        seen = count + offset + stop
        logits = torch.matmul(grouped[:, :, start:stop], keys[:, None, :seen].transpose(-1, -2))
        # only the new tokens' columns can lie ahead of a query: mask those alone, in place
        where = offset + torch.arange(start, stop, device=keys.device)
        ahead = torch.arange(seen - count, device=keys.device)[None, :] > where[:, None]
        logits[..., count:].masked_fill_(ahead, float("-inf"))
        yield offset + start, torch.softmax(logits, dim=-1)[..., :count]
