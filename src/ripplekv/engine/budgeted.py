"""Decoding under a total budget (`--decode-budget total`): the step-by-step path, with eviction.

Divergence decoding (`engine.divergence`) reads the whole forced answer in one forward, which cannot evict
step by step, so this mode does not use it: a variant's tokens come from plain greedy decoding with its
evictors attached (`engine.evict`), and its fidelity from a teacher-forced pass that feeds the full
answer one token at a time through a second copy of its cache, evicting exactly as decoding would. The
batch of one call shares one policy (one method, at any budgets).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import LOGPROB_BYTES, Fidelity, Reference, fidelity, forward_tokens, greedy_decode
from ripplekv.engine.evict import DecodePolicy, attach
from ripplekv.engine.prefill import PrefillState


@torch.inference_mode()
def forced_logprobs(model, state: PrefillState, variants: list, policy: DecodePolicy, caps: list[np.ndarray],
                    tokens: list[int], on_step=None) -> torch.Tensor:
    """Log-probs [V, T, vocab] along `tokens`, fed one per step through evicting caches.

    `on_step(cache, step)` (tests) sees the cache after each step's eviction."""
    cache = build_cache(state, variants)
    attach(cache, state, variants, policy, caps)
    rows = [torch.log_softmax(state.last_logits, -1)[None].expand(cache.num_variants, -1)]
    for step, token in enumerate(tokens[:-1]):
        fed = torch.full((cache.num_variants, 1), int(token), dtype=torch.long, device=state.device)
        rows.append(torch.log_softmax(forward_tokens(model, cache, fed, state.length + step, logits_to_keep=1)[:, -1], -1))
        if on_step is not None:
            on_step(cache, step + 1)
    return torch.stack(rows, dim=1)


def decode_in_budget(model, state: PrefillState, variants: list, policy: DecodePolicy, caps: list[np.ndarray],
                     reference: Reference, max_new_tokens: int, stop_ids: Iterable[int] = (),
                     batch_size: int = 16) -> tuple[list[list[int]], list[Fidelity]]:
    """Greedy tokens and fidelity of variants that share `policy`, each held at its capacity `caps[v]` [L, H]."""
    tokens: list[list[int]] = []
    quality: list[Fidelity] = []
    per_variant = max(1, len(reference.tokens) * int(reference.logprobs.shape[-1]) * 4)
    chunk = max(1, min(batch_size, LOGPROB_BYTES // per_variant))
    for start in range(0, len(variants), chunk):
        part, part_caps = variants[start : start + chunk], caps[start : start + chunk]
        tokens.extend(greedy_decode(model, state, part, max_new_tokens, stop_ids,
                                    prepare=lambda cache, p=part, c=part_caps: attach(cache, state, p, policy, c)))
        logprobs = forced_logprobs(model, state, part, policy, part_caps, reference.tokens)
        quality.extend(fidelity(reference.logprobs, logprobs, reference.tokens))
    return tokens, quality
