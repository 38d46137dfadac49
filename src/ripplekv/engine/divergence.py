"""Divergence decoding: decode only where a variant's greedy answer leaves the full cache's answer.

The teacher-forced pass (fed the full cache's answer, for KL and agreement) already gives every variant's
greedy choice at every answer position. Up to its first disagreement a variant's greedy answer IS the full
answer; at that position its own choice is known too. So a variant that never disagrees needs no decoding,
and one that does continues from the cache the teacher-forced pass filled: the forced tokens past its
divergence are hidden from it (`CompressedLayer.hidden`), its new tokens take the positions right after its
own answer so far, and the variants of a group still running decode on, in that same cache (never copied).
Groups are cut by kept length within a byte bound (`memory.plan_groups`); a group's entries are built
only when it runs (`memory.LazyVariants`), so memory holds the fixed part and one group at a time.

Greedy outputs equal plain greedy decoding (`decode.greedy_decode`) up to floating-point ties: the forced
pass computes the shared prefix's keys in one forward instead of one token at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ripplekv.engine import timings
from ripplekv.engine.cache import CompressedCache, build_lazily
from ripplekv.engine.decode import Fidelity, Reference, fidelity, fidelity_groups, forward_tokens
from ripplekv.engine.memory import LazyVariants
from ripplekv.engine.prefill import PrefillState


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
    variants,
    reference: Reference,
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    prefix: list[int] | None = None,
    fidelity_batch: int = 16,
    memory_bytes: int | None = None,
    room_after=None,
) -> DivergenceResult:
    """Greedy tokens and fidelity of every variant from one teacher-forced pass along the full answer.

    `variants`: built entries per variant, or `LazyVariants` (built when their group runs). The forced pass
    runs in the groups of `decode.fidelity_groups` (at most `fidelity_batch` variants of similar length,
    together under `memory_bytes`, exactly as `decode.measure_fidelity`, so KL and agreement are the same
    numbers); a group's variants still running after their divergence then decode on in its own cache.
    `room_after()`, when given, is the bytes left once a group is done: the variants still to run are then
    grouped again within it (what the sample holds can grow: scores a build caches, the allocator's keep).
    """
    source = LazyVariants.of(variants)
    stop = {int(t) for t in stop_ids}
    prefix = list(prefix or [])
    answer = list(reference.tokens)
    fed = prefix + answer[:-1]  # what the forced pass reads through each variant's cache
    base = state.length + len(prefix)  # position of the first answer token
    result = DivergenceResult(tokens=[None] * len(source), fidelity=[None] * len(source))
    for picked in _groups(model, state, source.lengths, reference, fidelity_batch, prefix, memory_bytes,
                          max_new_tokens, room_after):
        with timings.phase(timings.TEACHER_FORCED):  # the builds inside count as their methods'
            cache = build_lazily(state, (source.build(i) for i in picked), [source.lengths[i] for i in picked])
            logprobs = _forced_logprobs(model, state, cache, fed, len(prefix))
            for i, one in zip(picked, fidelity(reference.logprobs, logprobs, answer)):
                result.fidelity[i] = one
            choices = logprobs.argmax(-1).tolist()  # [V, T]
            del logprobs
        keep, hidden, rows, starts = [], [], [], []
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
            with timings.phase(timings.DIVERGENCE_DECODE):
                if len(keep) < len(picked):  # the group's cache is its own: rows move down, never copied
                    cache.select_variants(torch.tensor(keep, dtype=torch.long, device=state.device), in_place=True)
                _hide_after_divergence(cache, torch.stack(hidden))
                result.decoded += len(rows)
                result.batches += 1
                _greedy_rows(model, cache, rows, starts, result, max_new_tokens, stop)
        del cache
    return result


def _hide_after_divergence(cache, mask: torch.Tensor) -> None:
    """Give every layer of `cache` the forced answer's positions each row must not see (a helper, so that no loop
    variable keeps a finished group's last layer alive into the next group's build)."""
    for layer in cache.layers:
        layer.hidden = mask


def _groups(model, state, lengths, reference, batch_size, prefix, memory_bytes, max_new_tokens, room_after):
    """`decode.fidelity_groups` in turn; with `room_after`, the variants left are grouped again after each."""
    if room_after is None:
        yield from fidelity_groups(model, state, lengths, reference, batch_size, prefix, memory_bytes, max_new_tokens)
        return
    pending = list(range(len(lengths)))
    bound = memory_bytes
    while pending:
        first = fidelity_groups(model, state, [lengths[i] for i in pending], reference, batch_size, prefix, bound,
                                max_new_tokens)[0]
        picked = [pending[i] for i in first]
        yield picked
        taken = set(picked)
        pending = [i for i in pending if i not in taken]
        if pending:
            bound = room_after()


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
            cache.select_variants(index, in_place=True)
            positions = positions.index_select(0, index)
        positions = positions + 1


DECODINGS = ("divergence", "plain")


def decode_variants(model, state: PrefillState, variants, reference: Reference, how,
                    stop_ids: Iterable[int] = (), prefix: list[int] | None = None, memory_bytes: int | None = None,
                    room_after=None) -> tuple[list[list[int]], list[Fidelity]]:
    """Greedy tokens and fidelity of every variant (built entries or `LazyVariants`) as `how` (a `schedule.Decoding`,
    not imported: schedule imports this module) says: `how.max_new_tokens` at most,
    `how.batch_size` variants a pass: by divergence from the full answer (`how.decoding` "divergence"), or
    "plain": each group decoded from its first token, then a separate forced pass (the reference divergence
    decoding is checked against; it holds a group's entries beside its cache). `room_after`: as
    `decode_by_divergence` takes it (divergence decoding only)."""
    from ripplekv.engine.decode import greedy_decode, measure_fidelity

    max_new_tokens, batch_size, decoding = how.max_new_tokens, how.batch_size, how.decoding
    if decoding == "divergence":
        result = decode_by_divergence(model, state, variants, reference, max_new_tokens, stop_ids, prefix, batch_size,
                                      memory_bytes, room_after)
        return result.tokens, result.fidelity
    if decoding != "plain":
        raise ValueError(f"decoding must be one of {DECODINGS}, got {decoding!r}")
    source = LazyVariants.of(variants)
    tokens: list = [None] * len(source)
    quality: list = [None] * len(source)
    for picked in fidelity_groups(model, state, source.lengths, reference, batch_size, prefix, memory_bytes,
                                  max_new_tokens):
        built = [source.build(i) for i in picked]
        with timings.phase(timings.PLAIN_DECODE):
            decoded = greedy_decode(model, state, built, max_new_tokens, stop_ids, prefix=prefix)
        with timings.phase(timings.TEACHER_FORCED):
            measured = measure_fidelity(model, state, built, reference, batch_size, prefix=prefix,
                                        memory_bytes=memory_bytes)
        for i, one, fid in zip(picked, decoded, measured):
            tokens[i], quality[i] = one, fid
        del built  # before the next group builds: the bound counts one group's entries at a time
    return tokens, quality
