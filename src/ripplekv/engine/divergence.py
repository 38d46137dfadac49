"""Divergence decoding: decode only where a variant's greedy answer leaves the full cache's answer.

The teacher-forced pass (fed the full cache's answer, for KL and agreement) already gives every variant's
greedy choice at every answer position. Up to its first disagreement a variant's greedy answer IS the full
answer; at that position its own choice is known too. So a variant that never disagrees needs no decoding,
and one that does continues from the cache the teacher-forced pass filled: the forced tokens past its
divergence are hidden from it (`CompressedLayer.hidden`), its new tokens take the positions right after its
own answer so far, and the variants of a group still running decode on, in that same cache (never copied).
Groups are cut by kept length within a byte bound (`memory.plan_groups`); a group's entries are built
only when it runs (`memory.LazyVariants`), so memory holds the fixed part and one group at a time. The rows of
one cache may ask different questions of one context (`diverge_rows`, for `engine.questions`): each reads its own
question, is forced along its own reference, and decodes without seeing the padding that evens it with longer rows.

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
    result = DivergenceResult(tokens=[None] * len(source), fidelity=[None] * len(source))
    for picked in _groups(model, state, source.lengths, reference, fidelity_batch, prefix, memory_bytes,
                          max_new_tokens, room_after):
        with timings.phase(timings.TEACHER_FORCED):  # the builds inside count as their methods'
            cache = build_lazily(state, (source.build(i) for i in picked), [source.lengths[i] for i in picked])
        diverge_rows(model, state, cache, [(prefix, reference)] * len(picked), picked, result, max_new_tokens, stop)
        del cache
    return result


def diverge_rows(model, state: PrefillState, cache: CompressedCache, asks, slots, result: DivergenceResult,
                 max_new_tokens: int, stop) -> None:
    """Row r of `cache` reads `asks[r]` = (prefix, reference): its prefix, then is forced along the reference's
    answer (one forward for every row), and decodes on from its first disagreement; its tokens and fidelity go to
    `result` at `slots[r]`. Rows may ask different questions (several questions of one context in one pass):
    each is measured against its own reference, and the padding that evens a row with longer ones is hidden from it."""
    fed = [list(prefix) + list(reference.tokens[:-1]) for prefix, reference in asks]
    width = max(map(len, fed))
    with timings.phase(timings.TEACHER_FORCED):
        logprobs = forced_rows(model, state, cache, [prefix for prefix, _ in asks], [r.tokens for _, r in asks])
        for reference, rows in _rows_by_reference(asks):
            answer = list(reference.tokens)
            part = logprobs if len(rows) == len(asks) else logprobs[rows]
            for row, one in zip(rows, fidelity(reference.logprobs, part[:, : len(answer)], answer)):
                result.fidelity[slots[row]] = one
        choices = logprobs.argmax(-1).tolist()  # [R, T]
        del logprobs
    keep, hidden, rows, starts = [], [], [], []
    for row, ((prefix, reference), own) in enumerate(zip(asks, choices)):
        answer, variant = list(reference.tokens), slots[row]
        split = _divergence(own[: len(answer)], answer)
        if split is None:  # agrees everywhere, so it also stops where the full answer stops
            result.tokens[variant] = answer
            continue
        tokens = answer[:split] + [int(own[split])]
        result.tokens[variant] = tokens
        if tokens[-1] in stop or len(tokens) >= max_new_tokens:
            continue
        keep.append(row)
        rows.append(variant)
        starts.append(state.length + len(prefix) + split)
        visible = torch.zeros(width, dtype=torch.float32, device=state.device)
        visible[len(prefix) + split :] = float("-inf")
        hidden.append(visible)
    if keep:
        with timings.phase(timings.DIVERGENCE_DECODE):
            if len(keep) < len(asks):  # the group's cache is its own: rows move down, never copied
                cache.select_variants(torch.tensor(keep, dtype=torch.long, device=state.device), in_place=True)
            hide(cache, torch.stack(hidden))
            result.decoded += len(rows)
            result.batches += 1
            greedy_rows(model, cache, rows, starts, result, max_new_tokens, stop)


def _rows_by_reference(asks):
    """(reference, the rows forced along it), in the order each reference first appears."""
    rows: dict[int, tuple] = {}
    for row, (_, reference) in enumerate(asks):
        rows.setdefault(id(reference), (reference, []))[1].append(row)
    return list(rows.values())


def hide(cache, mask: torch.Tensor) -> None:
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


def forced_rows(model, state: PrefillState, cache: CompressedCache, prefixes, answers) -> torch.Tensor:
    """Log-probs [R, T, vocab] (T: the longest answer) of each row of `cache` along its answer, read after its
    prefix, as `decode.teacher_forced_logprobs`; fills `cache` with what each row was fed (its prefix and answer
    but the last token, right-padded to the longest: no real token sees the padding, which comes after it). A
    row's positions past its own answer hold zeros."""
    if len({len(p) for p in prefixes}) == 1 and len({len(a) for a in answers}) == 1:  # one shape: as ever
        return _forced_logprobs(model, state, cache, list(prefixes[0]) + list(answers[0][:-1]), len(prefixes[0]),
                                [list(p) + list(a[:-1]) for p, a in zip(prefixes, answers)])
    fed = [list(p) + list(a[:-1]) for p, a in zip(prefixes, answers)]
    width = max(map(len, fed))
    tokens = torch.tensor([row + [row[-1] if row else 0] * (width - len(row)) for row in fed], dtype=torch.long,
                          device=state.device)
    start = min(len(prefix) - 1 if prefix else 0 for prefix in prefixes)  # no answer is read before it: no logits
    read = torch.log_softmax(forward_tokens(model, cache, tokens, state.length, logits_to_keep=width - start), -1)
    first = torch.log_softmax(state.last_logits, -1)
    out = read.new_zeros(len(fed), max(map(len, answers)), read.shape[-1])
    for row, (prefix, answer) in enumerate(zip(prefixes, answers)):
        if prefix:
            at = len(prefix) - 1 - start
            out[row, : len(answer)] = read[row, at : at + len(answer)]
        else:  # the answer's first token comes from the prefill
            out[row, 0] = first
            out[row, 1 : len(answer)] = read[row, : len(answer) - 1]
    return out


def _forced_logprobs(model, state: PrefillState, cache: CompressedCache, fed: list[int], prefix_length: int,
                     rows: list[list[int]] | None = None):
    """Log-probs [V, T, vocab] along the answer, as `decode.teacher_forced_logprobs`, filling `cache` (`rows`: what
    each row reads, all of `fed`'s length; default `fed` in every row)."""
    if rows is not None and all(row == fed for row in rows):
        rows = None
    if prefix_length:
        tokens = _fed(state, cache, fed, rows)
        logits = forward_tokens(model, cache, tokens, state.length)
        return torch.log_softmax(logits[:, prefix_length - 1 :], -1)
    first = torch.log_softmax(state.last_logits, -1)[None, None].expand(cache.num_variants, 1, -1)
    if not fed:
        return first.clone()
    rest = torch.log_softmax(forward_tokens(model, cache, _fed(state, cache, fed, rows), state.length), -1)
    return torch.cat([first, rest], dim=1)


def _fed(state, cache, fed, rows):
    """[V, P] tokens: `fed` in every row (expanded, as ever), or each row its own."""
    if rows is None:
        return torch.tensor(fed, dtype=torch.long, device=state.device)[None].expand(cache.num_variants, -1)
    return torch.tensor(rows, dtype=torch.long, device=state.device)


def greedy_rows(model, cache, rows, starts, result, max_new_tokens, stop, record=None) -> None:
    """Decode `rows` (variant indices into result.tokens) from their last token until stop or the limit;
    `record(rows, logits)`, when given, sees each step's float32 logits [rows still running, vocab]."""
    device = cache.layers[0].prompt_keys.device
    active = list(rows)
    positions = torch.tensor(starts, dtype=torch.long, device=device)
    while active:
        last = torch.tensor([[result.tokens[v][-1]] for v in active], dtype=torch.long, device=device)
        out = model(input_ids=last, position_ids=positions[:, None], cache=cache, use_cache=True,
                    ripplekv_cache=cache, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        if record is not None:
            record(active, logits)
        chosen = logits.argmax(-1).tolist()
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
