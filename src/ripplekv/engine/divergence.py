"""Divergence decoding: decode only where a variant's greedy answer leaves the full cache's answer.

The teacher-forced pass (fed the full cache's answer, for KL and agreement) already gives every variant's
greedy choice at every answer position. Up to its first disagreement a variant's greedy answer IS the full
answer; at that position its own choice is known too. So a variant that never disagrees needs no decoding,
and one that does continues from the cache the teacher-forced pass filled: the forced tokens past its
divergence are hidden from it (`CompressedLayer.hidden`), its new tokens take the positions right after its
own answer so far, and every variant still running decodes in one batch, as large as memory allows.

Greedy outputs equal plain greedy decoding (`decode.greedy_decode`) up to floating-point ties: the forced
pass computes the shared prefix's keys in one forward instead of one token at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ripplekv.engine.cache import CompressedCache, CompressedLayer, build_cache, concat_caches
from ripplekv.engine.decode import LOGPROB_BYTES, Fidelity, Reference, fidelity, forward_tokens
from ripplekv.engine.prefill import PrefillState

# Keep the caches of the variants decoded together under this many bytes (kept entries, decoded tokens,
# one step's attention scores); the batch holds every running variant that fits.
DECODE_BYTES = 2 * 2**30


@dataclass
class DivergenceResult:
    """Every variant's greedy tokens and fidelity, and how much decoding divergence left to do."""

    tokens: list[list[int]]
    fidelity: list[Fidelity]
    decoded: int = 0  # variants that needed any decoding after their divergence
    steps: int = 0  # decoding forward passes (each over a batch of running variants)
    batches: int = 0


def variant_bytes(cache: CompressedCache, extra_tokens: int, lengths: list[int] | None = None) -> int:
    """Memory one variant of `cache` takes in a decoding batch, `extra_tokens` more decoded tokens included
    (`lengths`: kept entries per layer after padding, when batched with other caches)."""
    total = 0
    for index, layer in enumerate(cache.layers):
        heads, length, dim = layer.prompt_keys.shape[1:]
        length = lengths[index] if lengths is not None else length
        element = layer.prompt_keys.element_size()
        decoded = layer.decoded_length() + extra_tokens
        total += 2 * heads * (length + decoded) * dim * element  # keys and values
        total += heads * (length + decoded) * 4 * 3  # bias and the step's float32 scores and weights
    return total


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

    The forced pass runs in chunks of `fidelity_batch` variants (bounded by the log-prob memory, exactly
    as `decode.measure_fidelity`, so KL and agreement are the same numbers); the variants still running
    after their divergence are then decoded together in batches bounded by `memory_bytes`.
    """
    stop = {int(t) for t in stop_ids}
    prefix = list(prefix or [])
    answer = list(reference.tokens)
    per_variant = max(1, (len(answer) + len(prefix)) * int(reference.logprobs.shape[-1]) * 4)
    chunk = max(1, min(fidelity_batch, LOGPROB_BYTES // per_variant))
    fed = prefix + answer[:-1]  # what the forced pass reads through each variant's cache
    base = state.length + len(prefix)  # position of the first answer token
    result = DivergenceResult(tokens=[], fidelity=[])
    running: list[tuple[int, CompressedCache, list[int]]] = []  # (chunk's first variant, its cache, running rows)
    starts: list[int] = []  # per running variant: the position of the token it feeds next
    for first in range(0, len(variants), chunk):
        part = variants[first : first + chunk]
        cache = build_cache(state, part)
        logprobs = _forced_logprobs(model, state, cache, fed, len(prefix))
        result.fidelity.extend(fidelity(reference.logprobs, logprobs, answer))
        choices = logprobs.argmax(-1).tolist()  # [V, T]
        del logprobs
        keep, hidden = [], []
        for row, own in enumerate(choices):
            split = _divergence(own, answer)
            if split is None:  # agrees everywhere, so it also stops where the full answer stops
                result.tokens.append(list(answer))
                continue
            tokens = answer[:split] + [int(own[split])]
            result.tokens.append(tokens)
            if tokens[-1] in stop or len(tokens) >= max_new_tokens:
                continue
            keep.append(row)
            starts.append(base + split)
            visible = torch.zeros(len(fed), dtype=torch.float32, device=state.device)
            visible[len(prefix) + split :] = float("-inf")
            hidden.append(visible)
        if keep:
            cache.select_variants(torch.tensor(keep, dtype=torch.long, device=state.device))
            mask = torch.stack(hidden)
            for layer in cache.layers:
                layer.hidden = mask
            running.append((first, cache, keep))
    rows = [first + r for first, _, keep in running for r in keep]
    result.decoded = len(rows)
    if not rows:
        return result
    caches = [cache for _, cache, _ in running]
    running.clear()  # the batches below own the caches from here (a merged batch frees its parts)
    _decode_rows(model, caches, rows, starts, result, max_new_tokens, stop, memory_bytes)
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


def _decode_rows(model, caches, rows, starts, result, max_new_tokens, stop, memory_bytes) -> None:
    """Greedy decoding of the running variants (`rows`; `caches` hold them in order) in as few batches as
    `memory_bytes` allows: one batch of every running variant when they fit."""
    owners = [(c, local) for c, cache in enumerate(caches) for local in range(cache.num_variants)]
    padded = [max(cache.layers[i].prompt_keys.shape[2] for cache in caches) for i in range(len(caches[0].layers))]
    each = variant_bytes(caches[0], max_new_tokens, padded)
    per_batch = max(1, memory_bytes // max(1, each))
    for begin in range(0, len(rows), per_batch):
        picked = range(begin, min(begin + per_batch, len(rows)))
        if len(picked) == len(rows):
            batch = concat_caches(caches)
            caches.clear()
        else:
            parts = {}
            for i in picked:
                parts.setdefault(owners[i][0], []).append(owners[i][1])
            batch = concat_caches([_subset(caches[c], locals_) for c, locals_ in parts.items()])
        result.batches += 1
        _greedy_rows(model, batch, [rows[i] for i in picked], [starts[i] for i in picked], result,
                     max_new_tokens, stop)


def _subset(cache: CompressedCache, picked: list[int]) -> CompressedCache:
    """A new cache of some variants of `cache`, which stays whole."""
    index = torch.tensor(picked, dtype=torch.long, device=cache.layers[0].prompt_keys.device)
    layers = []
    for layer in cache.layers:
        one = CompressedLayer(layer.prompt_keys, layer.prompt_values, layer.prompt_bias, layer.original_length)
        one.keys, one.values, one.hidden = layer.keys, layer.values, layer.hidden
        one.batch_select_indices(index)
        layers.append(one)
    return CompressedCache(layers, len(picked))


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
