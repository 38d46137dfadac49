"""Divergence decoding: decode only where a variant's greedy answer leaves the full cache's answer.

The teacher-forced pass (fed the full cache's answer, for KL and agreement) already gives every variant's
greedy choice at every answer position. Up to its first disagreement a variant's greedy answer IS the full
answer; at that position its own choice is known too. So a variant that never disagrees needs no decoding,
and one that does continues from the cache the teacher-forced pass filled: the forced tokens past its
divergence are hidden from it (`CompressedLayer.hidden`), its new tokens take the positions right after its
own answer so far, and the variants still running decode in batches of similar kept length
(`decoding_groups`), within a memory bound.

Greedy outputs equal plain greedy decoding (`decode.greedy_decode`) up to floating-point ties: the forced
pass computes the shared prefix's keys in one forward instead of one token at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ripplekv.engine.cache import CompressedCache, build_cache, gather_rows
from ripplekv.engine.decode import Fidelity, Reference, fidelity, fidelity_chunks, forward_tokens
from ripplekv.engine.prefill import PrefillState

# Keep the caches of the variants decoded together under this many bytes (kept entries, decoded tokens,
# one step's attention scores).
DECODE_BYTES = 2 * 2**30


@dataclass
class DivergenceResult:
    """Every variant's greedy tokens and fidelity, and how much decoding divergence left to do."""

    tokens: list[list[int]]
    fidelity: list[Fidelity]
    decoded: int = 0  # variants that needed any decoding after their divergence
    steps: int = 0  # decoding forward passes (each over a batch of running variants)
    batches: int = 0


def entry_bytes(cache: CompressedCache) -> list[int]:
    """Bytes one kept entry or decoded token costs a variant in a decoding batch, per layer: its keys and
    values, plus its bias and the step's float32 scores and weights."""
    return [layer.prompt_keys.shape[1] * (2 * layer.prompt_keys.shape[3] * layer.prompt_keys.element_size() + 4 * 3)
            for layer in cache.layers]


def variant_bytes(cache: CompressedCache, extra_tokens: int, lengths: list[int] | None = None) -> int:
    """Memory one variant of `cache` takes in a decoding batch, `extra_tokens` more decoded tokens included
    (`lengths`: kept entries per layer after padding, when batched with other caches)."""
    return sum(each * ((lengths[index] if lengths is not None else layer.prompt_keys.shape[2])
                       + layer.decoded_length() + extra_tokens)
               for index, (layer, each) in enumerate(zip(cache.layers, entry_bytes(cache))))


def _divergence(choices: list[int], answer: list[int]) -> int | None:
    """The first answer position where the variant's greedy choice differs from the full answer."""
    for index, (chosen, token) in enumerate(zip(choices, answer)):
        if chosen != token:
            return index
    return None


@torch.inference_mode()
def decode_by_divergence(
    model,
    state: PrefillState,
    variants: list,
    reference: Reference,
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    prefix: list[int] | None = None,
    fidelity_batch: int = 16,
    memory_bytes: int = DECODE_BYTES,
) -> DivergenceResult:
    """Greedy tokens and fidelity of every variant from one teacher-forced pass along the full answer.

    The forced pass runs in the chunks of `decode.fidelity_chunks` (at most `fidelity_batch` variants of
    similar length, exactly as `decode.measure_fidelity`, so KL and agreement are the same numbers); the
    variants still running after their divergence are then decoded in the batches `decoding_groups` picks.
    """
    stop = {int(t) for t in stop_ids}
    prefix = list(prefix or [])
    answer = list(reference.tokens)
    fed = prefix + answer[:-1]  # what the forced pass reads through each variant's cache
    base = state.length + len(prefix)  # position of the first answer token
    result = DivergenceResult(tokens=[None] * len(variants), fidelity=[None] * len(variants))
    running: list[CompressedCache] = []  # per forced chunk with variants still running: its cache of them
    rows: list[int] = []  # the running variants, in the order of those caches
    starts: list[int] = []  # per running variant: the position of the token it feeds next
    for picked in fidelity_chunks(variants, reference, fidelity_batch, prefix):
        cache = build_cache(state, [variants[i] for i in picked])
        logprobs = _forced_logprobs(model, state, cache, fed, len(prefix))
        for i, one in zip(picked, fidelity(reference.logprobs, logprobs, answer)):
            result.fidelity[i] = one
        choices = logprobs.argmax(-1).tolist()  # [V, T]
        del logprobs
        keep, hidden = [], []
        for row, (variant, own) in enumerate(zip(picked, choices)):
            split = _divergence(own, answer)
            if split is None:  # agrees everywhere, so it also stops where the full answer stops
                result.tokens[variant] = list(answer)
                continue
            tokens = answer[:split] + [int(own[split])]
            result.tokens[variant] = tokens
            if tokens[-1] in stop or len(tokens) >= max_new_tokens:
                continue
            keep.append(row)
            rows.append(variant)
            starts.append(base + split)
            visible = torch.zeros(len(fed), dtype=torch.float32, device=state.device)
            visible[len(prefix) + split :] = float("-inf")
            hidden.append(visible)
        if keep:
            cache.select_variants(torch.tensor(keep, dtype=torch.long, device=state.device))
            mask = torch.stack(hidden)
            for layer in cache.layers:
                layer.hidden = mask
            running.append(cache)
    result.decoded = len(rows)
    if not rows:
        return result
    lengths = [[layer.capacity for layer in variants[v]] for v in rows]
    _decode_rows(model, running, rows, starts, result, max_new_tokens, stop, memory_bytes, lengths)
    return result


def _forced_logprobs(model, state: PrefillState, cache: CompressedCache, fed: list[int], prefix_length: int):
    """Log-probs [V, T, vocab] along the answer, as `decode.teacher_forced_logprobs`, filling `cache`."""
    if prefix_length:
        tokens = torch.tensor(fed, dtype=torch.long, device=state.device)
        logits = forward_tokens(model, cache, tokens[None].expand(cache.num_variants, -1), state.length)
        return torch.log_softmax(logits[:, prefix_length - 1 :], -1)
    first = torch.log_softmax(state.last_logits, -1)[None, None].expand(cache.num_variants, 1, -1)
    if not fed:
        return first.clone()
    tokens = torch.tensor(fed, dtype=torch.long, device=state.device)[None].expand(cache.num_variants, -1)
    rest = torch.log_softmax(forward_tokens(model, cache, tokens, state.length), -1)
    return torch.cat([first, rest], dim=1)


def _decode_rows(model, caches, rows, starts, result, max_new_tokens, stop, memory_bytes, lengths) -> None:
    """Greedy decoding of the running variants (`rows`; `caches` hold them in order; `lengths`: each one's
    kept entries per layer), in the batches `decoding_groups` picks, each padded to its own longest layers."""
    owners = [(c, local) for c, cache in enumerate(caches) for local in range(cache.num_variants)]
    remaining = [max_new_tokens - len(result.tokens[v]) for v in rows]
    fixed = variant_bytes(caches[0], max_new_tokens, [0] * len(lengths[0]))  # decoded tokens only
    for picked in decoding_groups(lengths, remaining, entry_bytes(caches[0]), fixed, memory_bytes):
        padded = [max(lengths[i][layer] for i in picked) for layer in range(len(lengths[0]))]
        batch = gather_rows(caches, [owners[i] for i in picked], padded)
        result.batches += 1
        _greedy_rows(model, batch, [rows[i] for i in picked], [starts[i] for i in picked], result,
                     max_new_tokens, stop)
        del batch


# Cost of one decoding step on a 2-core CPU (scripts/bench_batch.py, bundled model, milliseconds): a fixed
# part per forward (reading every weight), a part per variant (its linear layers), and a part per variant and
# prompt entry it attends to, summed over layers, padding included (memory-bound attention).
STEP_MS, VARIANT_MS, ENTRY_MS = 100.0, 5.0, 3.1e-4


def decoding_groups(lengths: list[list[int]], remaining: list[int], entry_bytes: list[int], fixed_bytes: int,
                    memory_bytes: int) -> list[list[int]]:
    """Split running variants into decoding batches at the least modelled cost.

    One batch pays one forward per step but pads every variant to the longest kept layer of any; more
    batches pad less and pay more forwards. Variants are ordered by their total kept length and cut into
    contiguous groups by dynamic programming over the cost model above (steps bounded by each variant's
    remaining tokens). A group of k variants padded to P_l entries in layer l takes
    k * (sum_l entry_bytes[l] * P_l + fixed_bytes) and stays under `memory_bytes`; one variant always fits.
    """
    order = sorted(range(len(lengths)), key=lambda i: (sum(lengths[i]), i))
    count = len(order)
    best = [0.0] + [float("inf")] * count
    cut = [0] * (count + 1)
    for first in range(count):
        padded = [0] * len(lengths[0])
        steps = variant_steps = 0
        for last in range(first, count):
            row = order[last]
            padded = [max(p, q) for p, q in zip(padded, lengths[row])]
            steps = max(steps, remaining[row])
            variant_steps += remaining[row]
            size = last - first + 1
            if size > 1 and size * (sum(e * p for e, p in zip(entry_bytes, padded)) + fixed_bytes) > memory_bytes:
                break
            cost = best[first] + steps * STEP_MS + variant_steps * (VARIANT_MS + ENTRY_MS * sum(padded))
            if cost < best[last + 1]:
                best[last + 1], cut[last + 1] = cost, first
    groups, end = [], count
    while end:
        groups.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return groups[::-1]


def _greedy_rows(model, cache, rows, starts, result, max_new_tokens, stop) -> None:
    """Decode `rows` (variant indices into result.tokens) from their last token until stop or the limit."""
    device = cache.layers[0].prompt_keys.device
    active = list(rows)
    positions = torch.tensor(starts, dtype=torch.long, device=device)
    while active:
        last = torch.tensor([[result.tokens[v][-1]] for v in active], dtype=torch.long, device=device)
        out = model(input_ids=last, position_ids=positions[:, None], cache=cache, use_cache=True,
                    ripplekv_cache=cache, logits_to_keep=1)
        chosen = out.logits[:, -1].float().argmax(-1).tolist()
        result.steps += 1
        still = []
        for row, (variant, token) in enumerate(zip(active, chosen)):
            result.tokens[variant].append(int(token))
            if int(token) not in stop and len(result.tokens[variant]) < max_new_tokens:
                still.append(row)
        if len(still) < len(active):
            active = [active[r] for r in still]
            if not active:
                break
            index = torch.tensor(still, dtype=torch.long, device=device)
            cache.select_variants(index)
            positions = positions.index_select(0, index)
        positions = positions + 1


DECODINGS = ("divergence", "plain")


def decode_variants(model, state: PrefillState, variants: list, reference: Reference, max_new_tokens: int,
                    stop_ids: Iterable[int] = (), prefix: list[int] | None = None, batch_size: int = 16,
                    decoding: str = "divergence") -> tuple[list[list[int]], list[Fidelity]]:
    """Greedy tokens and fidelity of every variant: by divergence from the full answer (the default), or
    "plain": each batch of `batch_size` decoded from its first token, then a separate forced pass (the
    reference divergence decoding is checked against)."""
    from ripplekv.engine.decode import greedy_decode, measure_fidelity

    if decoding == "divergence":
        result = decode_by_divergence(model, state, variants, reference, max_new_tokens, stop_ids, prefix, batch_size)
        return result.tokens, result.fidelity
    if decoding != "plain":
        raise ValueError(f"decoding must be one of {DECODINGS}, got {decoding!r}")
    tokens: list[list[int]] = []
    for start in range(0, len(variants), batch_size):
        tokens.extend(greedy_decode(model, state, variants[start : start + batch_size], max_new_tokens, stop_ids,
                                    prefix=prefix))
    return tokens, measure_fidelity(model, state, variants, reference, batch_size, prefix=prefix)
