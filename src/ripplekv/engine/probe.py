"""Teacher-forced passes through the full prompt cache that report each layer's new queries and keys.

Some scorers rank prompt entries by how much *later* tokens attend to them: KVzip by the queries of a
"repeat the context" pass, the oracle by the full-cache answer. Both feed tokens after the prompt
through the uncompressed cache; the attention function hands each layer's new queries and keys
(post-RoPE) to a callback, which reduces them at once, so no map over all prompt positions is kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ripplekv.engine.cache import build_cache
from ripplekv.engine.prefill import PrefillState

# callback(layer, queries [H_q, t, d], new_keys [H_kv, t, d]), both post-RoPE, for t tokens after the prompt
Probe = Callable[[int, torch.Tensor, torch.Tensor], None]


@torch.inference_mode()
def probe_tokens(model, state: PrefillState, tokens: list[int], callback: Probe) -> None:
    """Feed `tokens` right after the whole prompt (positions n, n+1, ...) through the full cache."""
    if not tokens:
        return
    cache = build_cache(state, None, 1)
    ids = torch.as_tensor(tokens, dtype=torch.long, device=state.device)[None]
    positions = torch.arange(state.length, state.length + ids.shape[1], device=ids.device)[None]

    def report(layer, query, key):
        callback(layer, query[0], key[0])

    model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, ripplekv_cache=cache,
          ripplekv_probe=report, logits_to_keep=1)


def causal_attention_rows(queries: torch.Tensor, prompt_keys: torch.Tensor, new_keys: torch.Tensor, scaling: float,
                          rows: int = 256):
    """Yield (start, attention [H_kv, group, r, K]) in blocks of `rows` new queries, float32, over the prompt
    keys `prompt_keys` [H_kv, K, d] (all visible) and the new tokens' keys [H_kv, t, d] (causal); the
    returned block keeps only the prompt part (its rows still sum to 1 with the new keys included)."""
    kv_heads, count = prompt_keys.shape[0], prompt_keys.shape[1]
    group = queries.shape[0] // kv_heads
    length = queries.shape[1]
    grouped = queries.float().view(kv_heads, group, length, -1) * scaling
    keys = torch.cat([prompt_keys.float(), new_keys.float()], dim=1)  # [H_kv, K + t, d]
    for start in range(0, length, rows):
        stop = min(length, start + rows)
        logits = torch.matmul(grouped[:, :, start:stop], keys[:, None].transpose(-1, -2)[:, :, :, : count + stop])
        later = torch.arange(count + stop, device=keys.device)[None, :] > (count + torch.arange(start, stop, device=keys.device))[:, None]
        logits = logits.masked_fill(later, float("-inf"))
        yield start, torch.softmax(logits, dim=-1)[..., :count]
