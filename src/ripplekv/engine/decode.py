"""Batched greedy decoding of several cache variants of one prompt, and teacher-forced fidelity.

All variants start from the same prefill (so their first token is the same: it comes from full
attention). New tokens take positions right after the original prompt, whatever was evicted.
Finished variants leave the batch, so a long-winded variant does not slow the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine.cache import CompressedCache, build_cache
from ripplekv.engine.decode_costs import costs_for
from ripplekv.engine.entries import LayerEntries
from ripplekv.engine.memory import DEFAULT_GROUP_BYTES, StepCosts, plan_groups
from ripplekv.engine.prefill import PrefillState

Variants = list[list[LayerEntries]] | None  # per variant, entries per layer; None = the full cache


def stop_tokens(model, tokenizer=None, stop_at_newline: bool = False) -> list[int]:
    """End-of-answer token ids: the model's generation config's (one id, several or none), the tokenizer's
    EOS when one is given, and the newline for tasks that stop at the end of a line (as LongBench's pred.py)."""
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    if tokenizer is not None:
        sources.insert(0, tokenizer.eos_token_id)
    for source in sources:
        if source is not None:
            ids.update(int(t) for t in (source if isinstance(source, (list, tuple)) else [source]))
    if stop_at_newline:
        if tokenizer is None:
            raise ValueError("stopping at a newline needs the tokenizer")
        ids.add(int(tokenizer.encode("\n", add_special_tokens=False)[-1]))
    return sorted(ids)


def kl_per_variant(clean: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """KL(clean || perturbed) of log-prob rows [.., P, vocab], averaged over the P positions (clamped at 0
    against rounding)."""
    return (clean.exp() * (clean - perturbed)).sum(-1).clamp_min(0.0).mean(-1)


def forward_tokens(model, cache: CompressedCache, tokens: torch.Tensor, start: int, logits_to_keep: int = 0):
    """Feed `tokens` [V, P] at positions start..start+P-1; returns float32 logits [V, P or 1, vocab]."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
    out = model(
        input_ids=tokens,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        ripplekv_cache=cache,
        logits_to_keep=logits_to_keep,
    )
    return out.logits.float()


@torch.inference_mode()
def greedy_decode(
    model,
    state: PrefillState,
    variants: Variants,
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    num_variants: int | None = None,
    prefix: list[int] | None = None,
    prepare=None,
) -> list[list[int]]:
    """Greedy tokens of every variant (stop tokens included when produced).

    `variants`: entries per layer for each variant; None decodes the full cache (`num_variants` copies).
    `prefix`: tokens read through the compressed cache before answering (the question, in the
    context-only protocol); without it the first token comes from the prefill and is the same for all.
    `prepare(cache)` runs on the new cache first (a total decode budget attaches its evictors there).
    """
    stop = set(int(t) for t in stop_ids)
    cache = build_cache(state, variants, num_variants)
    if prepare is not None:
        prepare(cache)
    total = cache.num_variants
    start = state.length + len(prefix or [])
    if prefix:
        fed = torch.tensor(prefix, dtype=torch.long, device=state.device)[None].expand(total, -1)
        firsts = forward_tokens(model, cache, fed, state.length, logits_to_keep=1)[:, -1].argmax(-1).tolist()
    else:
        firsts = [int(state.last_logits.argmax())] * total
    outputs = [[int(token)] for token in firsts]
    active = [i for i in range(total) if outputs[i][0] not in stop]
    if len(active) < total:
        cache.select_variants(torch.tensor(active, dtype=torch.long, device=state.device))
    for step in range(1, max_new_tokens):
        if not active:
            break
        last = torch.tensor([[outputs[i][-1]] for i in active], dtype=torch.long, device=state.device)
        logits = forward_tokens(model, cache, last, start + step - 1, logits_to_keep=1)
        chosen = logits[:, -1].argmax(-1).tolist()
        still = []
        for row, (variant, token) in enumerate(zip(active, chosen)):
            outputs[variant].append(int(token))
            if token not in stop:
                still.append(row)
        if len(still) < len(active):
            active = [active[r] for r in still]
            if active:
                cache.select_variants(torch.tensor(still, dtype=torch.long, device=state.device))
    return outputs


@dataclass(frozen=True)
class Fidelity:
    """How closely a variant follows the full cache along the full cache's own answer."""

    kl: float  # mean over answer tokens of KL(full || variant)
    agreement: float  # share of answer tokens where the variant's argmax equals the full cache's token


@torch.inference_mode()
def teacher_forced_logprobs(model, state: PrefillState, variants: Variants, tokens: list[int], num_variants=None,
                            prefix: list[int] | None = None):
    """Log-probs [V, T, vocab] (float32) of each variant at each answer position, feeding the given answer
    tokens (after `prefix`, read through the cache, when given)."""
    cache = build_cache(state, variants, num_variants)
    if prefix:
        fed = torch.tensor(list(prefix) + list(tokens[:-1]), dtype=torch.long, device=state.device)
        logits = forward_tokens(model, cache, fed[None].expand(cache.num_variants, -1), state.length)
        return torch.log_softmax(logits[:, len(prefix) - 1 :], -1)
    first = torch.log_softmax(state.last_logits, -1)[None, None].expand(cache.num_variants, 1, -1)
    if len(tokens) <= 1:
        return first.clone()
    fed = torch.tensor(tokens[:-1], dtype=torch.long, device=state.device)[None].expand(cache.num_variants, -1)
    rest = torch.log_softmax(forward_tokens(model, cache, fed, state.length), -1)
    return torch.cat([first, rest], dim=1)


def fidelity(reference_logprobs: torch.Tensor, variant_logprobs: torch.Tensor, tokens: list[int]) -> list[Fidelity]:
    """KL(full || variant) averaged over answer tokens, and argmax agreement with the full answer.

    reference_logprobs [T, vocab] (full cache); variant_logprobs [V, T, vocab].
    """
    kl = kl_per_variant(reference_logprobs[None], variant_logprobs)  # [V]
    target = torch.tensor(tokens, dtype=torch.long, device=variant_logprobs.device)[None]
    agree = (variant_logprobs.argmax(-1) == target).float().mean(-1)
    return [Fidelity(float(k), float(a)) for k, a in zip(kl.tolist(), agree.tolist())]


@dataclass(frozen=True)
class Reference:
    """The full cache's greedy answer and its log-probs: what every variant's fidelity is measured against."""

    tokens: list[int]
    logprobs: torch.Tensor  # [T, vocab]


@torch.inference_mode()
def full_reference(model, state: PrefillState, max_new_tokens: int, stop_ids: Iterable[int] = (),
                   prefix: list[int] | None = None) -> Reference:
    tokens = greedy_decode(model, state, None, max_new_tokens, stop_ids, num_variants=1, prefix=prefix)[0]
    return Reference(tokens, teacher_forced_logprobs(model, state, None, tokens, prefix=prefix)[0])


def fidelity_groups(model, state: PrefillState, lengths: list[list[int]], reference: Reference, batch_size: int,
                    prefix: list[int] | None = None, memory_bytes: int | None = None,
                    max_new_tokens: int | None = None) -> list[list[int]]:
    """The variants' indices (`lengths[i]`: variant i's kept entries per layer) in the groups a teacher-forced
    pass reads together: at most `batch_size`, of similar kept length (`memory.plan_groups`), each group under
    `memory_bytes` (default `memory.DEFAULT_GROUP_BYTES`) as `memory.StepCosts.group` counts it: the forced
    answer read in one forward, then decoding on to `max_new_tokens` in the same cache."""
    fed = max(1, len(prefix or []) + len(reference.tokens) - 1)
    held = fed + (max_new_tokens or len(reference.tokens))
    costs = StepCosts.of(model, state)
    return plan_groups(lengths, [fed] * len(lengths), lambda size, padded: costs.group(size, padded, fed, held),
                       memory_bytes or DEFAULT_GROUP_BYTES, most=batch_size, costs=costs_for(model, state))


@torch.inference_mode()
def measure_fidelity(model, state: PrefillState, variants: list, reference: Reference, batch_size: int = EVAL_BATCH_SIZE,
                     prefix: list[int] | None = None, memory_bytes: int | None = None) -> list[Fidelity]:
    """Fidelity of every variant to the reference, in `fidelity_groups`, in the order of `variants`."""
    result: list[Fidelity | None] = [None] * len(variants)
    lengths = [[layer.capacity for layer in variant] for variant in variants]
    for picked in fidelity_groups(model, state, lengths, reference, batch_size, prefix, memory_bytes):
        logprobs = teacher_forced_logprobs(model, state, [variants[i] for i in picked], reference.tokens, prefix=prefix)
        for i, one in zip(picked, fidelity(reference.logprobs, logprobs, reference.tokens)):
            result[i] = one
    return result
