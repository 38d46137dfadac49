"""Teacher-forced passes through the full prompt cache that report each layer's new queries and keys.

Some scorers rank prompt entries by how much *later* tokens attend to them: KVzip by the queries of a
"repeat the context" pass, the oracle by the full-cache answer. Both feed tokens after the prompt
through the uncompressed cache; the attention function hands each layer's new queries and keys
(post-RoPE) to a callback, which reduces them at once, so no map over all prompt positions is kept.
The model itself attends with sdpa through a plain transformers cache holding the prompt's keys and
values, as the prefill does: the full cache needs none of our compressed attention's biases, and the
eager float32 attention that would mean cost KVzip's pass over a 3.5k prompt about 4.7 prefills. On a CPU
KVzip's lower-right causal attention is unmasked flash attentions merged by their log-sum-exps
(`lower_right_attention`): sdpa with the mask costs ~30% more, and the log-sum-exps give KVzip its scores'
softmax normaliser for free.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv

from ripplekv.engine.cache import install
from ripplekv.engine.malloc import keeping_freed_memory
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


def can_split_attention(module, query) -> bool:
    """Whether `lower_right_attention` may run (a CPU, one sequence, a layer without a sliding window)."""
    return query.device.type == "cpu" and not getattr(module, "sliding_window", None) and query.shape[0] == 1


def lower_right_attention(query, key, value, scaling, subset=(), output: bool = True):
    """The model's attention for p new queries over n keys whose last p are theirs (causal among themselves,
    everything before visible), as ([1, p, H_q, d], lse [1, H_q, p] float32), on a CPU (`can_split_attention`).

    Flash attention over the p new keys (causal) and over the earlier ones (no mask), merged by their
    log-sum-exps: sdpa with the mask within float tolerance, ~30% faster. `subset`: ranges [lo, hi) of earlier
    keys attended apart from the rest, so that the returned lse is the softmax normaliser over them and the
    new keys alone (KVzip's scores' own softmax); without it, over the new keys alone. `output=False` returns
    (None, lse) without attending to the rest: the same lse, for a pass that needs no output from this layer."""
    length, count = query.shape[2], key.shape[2]
    kv_heads, groups = key.shape[1], query.shape[1] // key.shape[1]
    own = _FLASH_CPU(query, repeat_kv(key[:, :, count - length:], groups), repeat_kv(value[:, :, count - length:], groups),
                     0.0, True, scale=scaling)
    inside = [(lo, min(hi, count - length)) for lo, hi in subset if min(hi, count - length) > lo]
    outside, at = [], 0
    for lo, hi in sorted(inside):
        outside.append((at, lo))
        at = hi
    outside.append((at, count - length))
    # With no mask, a KV head's grouped query heads can attend as one longer sequence: no copies of the keys per head.
    stacked = query.reshape(1, kv_heads, groups * length, -1)
    apart = _unstacked(_flash_over(stacked, key, value, scaling, inside), query.shape)
    normaliser = merged([own, apart])[1]
    if not output:
        return None, normaliser
    rest = _unstacked(_flash_over(stacked, key, value, scaling, outside), query.shape)
    attended = merged([own, apart, rest])[0].to(query.dtype)
    return attended.transpose(1, 2).contiguous(), normaliser


def _unstacked(part, shape):
    """A stacked flash attention's (output, lse) back in query heads, [1, H_q, p, d] and [1, H_q, p]."""
    return None if part is None else (part[0].reshape(shape), part[1].reshape(shape[:3]))


def _flash_over(query, key, value, scaling, ranges):
    """Flash attention (no mask) over the keys in `ranges`, or None when they hold none."""
    ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
    if not ranges:
        return None
    if len(ranges) == 1:
        (lo, hi), = ranges
        return _FLASH_CPU(query, key[:, :, lo:hi], value[:, :, lo:hi], 0.0, False, scale=scaling)
    keys = torch.cat([key[:, :, lo:hi] for lo, hi in ranges], dim=2)
    values = torch.cat([value[:, :, lo:hi] for lo, hi in ranges], dim=2)
    return _FLASH_CPU(query, keys, values, 0.0, False, scale=scaling)


def merged(parts):
    """(output, lse) of attention over the union of disjoint key sets, from each set's (output, lse); None = empty."""
    parts = [part for part in parts if part is not None]
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])
    top = lses.amax(0)
    weights = (lses - top).exp_()
    total = weights.sum(0)
    output = sum(out * weight[..., None] for (out, _), weight in zip(parts, weights))
    return output / total[..., None], top + total.log()


class PassDone(Exception):
    """Raised by a pass's attention once its last layer has been read: a pass keeps only what its layers' queries
    and keys give, so nothing after the last layer's attention (its output, its MLP, the logits) is computed.
    `probe_tokens` catches it; the cache already holds every layer's keys and values of the piece."""


# Tokens fed per forward: bounds the attention of a piece over the prompt to PIECE x n scores per head.
PIECE = 512
# Query rows per block of scores: keeps the logits in a CPU's cache between the product and the reductions.
ROWS = 128


@torch.inference_mode()
def probe_tokens(model, state: PrefillState, tokens: list[int], callback: Probe | None = None, piece: int | None = None,
                 attend=None) -> None:
    """Feed `tokens` right after the whole prompt (positions n, n+1, ...) through the full cache, `piece` at a time
    (the same as one forward: the cache keeps the pieces already fed), handing each layer's queries and new keys
    to `callback`. `attend(module, query, key, value, mask, scaling)`, when given, is the pass's attention in place
    of sdpa with the model's mask (KVzip's, which scores as it attends); the oracles' passes of a few dozen answer
    tokens keep sdpa, bit for bit what results/ were computed with."""
    if not tokens:
        return
    install(model)
    cache = DynamicCache()  # no config: every layer attends to everything, as our own attention does
    for layer in range(state.num_layers):
        cache.update(state.keys[layer][None], state.values[layer][None], layer)
    ids = torch.as_tensor(tokens, dtype=torch.long, device=state.device)[None]
    piece = piece or PIECE
    # the cache hands attention the prompt's keys followed by the new ones
    probe = [Handing(lambda layer, query, key: callback(layer, query[0], key[0, :, state.length:]))] if callback else []
    with keeping_freed_memory():
        for start in range(0, ids.shape[1], piece):
            chunk = ids[:, start:start + piece]
            positions = torch.arange(state.length + start, state.length + start + chunk.shape[1], device=ids.device)[None]
            try:
                model(input_ids=chunk, position_ids=positions, cache=cache, use_cache=True, ripplekv_recorders=probe,
                      ripplekv_attend=attend, logits_to_keep=1)
            except PassDone:
                pass


def causal_attention_rows(queries: torch.Tensor, prompt_keys: torch.Tensor, new_keys: torch.Tensor, scaling: float,
                          rows: int = ROWS):
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
