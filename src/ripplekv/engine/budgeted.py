"""Decoding under a total budget (`--decode-budget total`): the step-by-step path, with eviction.

Divergence decoding (`engine.divergence`) reads the whole forced answer in one forward, which cannot evict
step by step, so this mode does not use it: a variant's tokens come from plain greedy decoding with its
evictors attached (`engine.evict`), and its fidelity from a teacher-forced pass that feeds the full
answer one token at a time through a second copy of its cache, evicting exactly as decoding would. Both
passes of every variant, whatever its method, run as rows of one batch, one token per step.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine import timings
from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import Fidelity, Reference, forward_tokens, kl_per_variant
from ripplekv.engine.decode_costs import costs_for
from ripplekv.engine.evict import DecodePolicy, attach, per_variant
from ripplekv.engine.memory import DEFAULT_GROUP_BYTES, LazyVariants, StepCosts, plan_groups
from ripplekv.engine.prefill import PrefillState


def decode_in_budget(model, state: PrefillState, variants, policy: DecodePolicy | list[DecodePolicy],
                     caps: list[np.ndarray], reference: Reference, max_new_tokens: int, stop_ids: Iterable[int] = (),
                     batch_size: int = EVAL_BATCH_SIZE, memory_bytes: int | None = None) -> tuple[list[list[int]], list[Fidelity]]:
    """Greedy tokens and fidelity of variants held at their capacities `caps[v]` [L, H].

    `variants`: built entries per variant, or `LazyVariants` (built when their batch runs). `policy`: one for
    all, or variant v's at v (several methods decode in one batch). Each variant runs twice in the same batch,
    one row decoding greedily and one fed the full answer (its fidelity), at most `batch_size` variants of
    similar length at a time, under `memory_bytes` (`memory.plan_groups`: both rows' caches and the built
    entries they were copied from); both evict exactly as decoding alone would."""
    source = LazyVariants.of(variants)
    policies = per_variant(policy, len(source))
    tokens: list = [None] * len(source)
    quality: list = [None] * len(source)
    costs = StepCosts.of(model, state)
    held = max_new_tokens + len(reference.tokens)
    groups = plan_groups(source.lengths, [max_new_tokens] * len(source),
                         lambda size, padded: costs.group(2 * size, padded, 1, held) + size * sum(padded) * costs.entry,
                         memory_bytes or DEFAULT_GROUP_BYTES, most=batch_size, costs=costs_for(model, state))
    for picked in groups:
        built = [source.build(i) for i in picked]
        with timings.phase(timings.BUDGETED_DECODE):
            got, fid = _decode_and_force(model, state, built, [policies[i] for i in picked],
                                         [caps[i] for i in picked], reference, max_new_tokens,
                                         set(int(t) for t in stop_ids))
        del built
        for i, one, measured in zip(picked, got, fid):
            tokens[i], quality[i] = one, measured
    return tokens, quality


@torch.inference_mode()
def _decode_and_force(model, state, variants, policies, caps, reference, max_new_tokens, stop):
    """Rows 0..V-1 decode greedily, rows V..2V-1 are fed the reference answer; KL and agreement are summed per
    step (never a [V, T, vocab] tensor). A row leaves the batch when its answer ends."""
    count = len(variants)
    cache = build_cache(state, variants + variants)
    attach(cache, state, variants + variants, policies + policies, caps + caps)
    answer = [int(t) for t in reference.tokens]
    first = int(state.last_logits.argmax())
    outputs = [[first] for _ in range(count)]
    first_lp = torch.log_softmax(state.last_logits.float(), -1)
    kl = [_kl(reference.logprobs[0], first_lp)] * count
    agree = [float(first == answer[0])] * count
    # row r of the batch: greedy variant r (r < count) or forced variant r - count
    active = ([r for r in range(count) if first not in stop and max_new_tokens > 1]
              + [count + v for v in range(count) if len(answer) > 1])
    if len(active) < 2 * count:
        cache.select_variants(torch.tensor(active, dtype=torch.long, device=state.device))
    step = 1
    while active:
        fed = [outputs[r][-1] if r < count else answer[step - 1] for r in active]
        tensor = torch.tensor(fed, dtype=torch.long, device=state.device)[:, None]
        logits = forward_tokens(model, cache, tensor, state.length + step - 1, logits_to_keep=1)[:, -1]
        keep = []
        for index, r in enumerate(active):
            if r < count:
                token = int(logits[index].argmax())
                outputs[r].append(token)
                done = token in stop or step + 1 >= max_new_tokens
            else:
                row = torch.log_softmax(logits[index], -1)
                kl[r - count] += _kl(reference.logprobs[step], row)
                agree[r - count] += float(int(row.argmax()) == answer[step])
                done = step + 1 >= len(answer)
            if not done:
                keep.append(index)
        step += 1
        if len(keep) < len(active):
            active = [active[i] for i in keep]
            if active:
                cache.select_variants(torch.tensor(keep, dtype=torch.long, device=state.device))
    return outputs, [Fidelity(k / len(answer), a / len(answer)) for k, a in zip(kl, agree)]


def _kl(clean: torch.Tensor, perturbed: torch.Tensor) -> float:
    """KL(clean || perturbed) of one position, as `decode.kl_per_variant` (clamped at 0 against rounding)."""
    return float(kl_per_variant(clean[None], perturbed[None]))
