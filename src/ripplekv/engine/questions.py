"""One compressed context, many questions: every variant is built once and answers each question in turn.

Serving prefills a long context once, caches it, and asks it many questions (prefix caching, multi-turn chat,
agents). Here the context is prefilled once (`PrefillState`), every (method, budget) variant compresses it once,
and each question's tokens are then read through a fresh cache made from those same entries (`build_lazily`
copies entries into the cache, so the entries themselves are never changed and serve the next question):
- the full cache answers each question first (its reference: the answer the variants' fidelity follows);
- the variants are cut into groups by kept length (`decode.fidelity_groups`, planned for the longest question and
  answer), a group's entries are built once, and the group answers every question in turn, batched as
  `divergence.decode_variants` decodes a single question today (divergence or plain decoding).
A group holds its built entries beside the cache of the question it is answering, so groups are planned within
half the bytes left (`memory.variant_room`). Nothing of the context is prefilled again: an extra question costs
its own tokens read through each variant's cache and its answer, not a prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

from ripplekv.engine import timings
from ripplekv.engine.decode import Reference, fidelity_groups, full_reference
from ripplekv.engine.memory import note_prefill_over, tensor_bytes, variant_room
from ripplekv.engine.prefill import PrefillState
from ripplekv.engine.schedule import Decoded, Decoding, SampleMemory, Variant, build


def question_references(model, state: PrefillState, questions: Sequence[Sequence[int]], max_new_tokens: int,
                        stops=()) -> list[Reference]:
    """The full cache's answer to each question (read after the prefilled context), in order."""
    with timings.phase(timings.REFERENCE_DECODE):
        return [full_reference(model, state, max_new_tokens, stops, prefix=list(question)) for question in questions]


def decode_questions(model, state: PrefillState, references: Sequence[Reference], questions: Sequence[Sequence[int]],
                     variants: Sequence[Variant], decoding: Decoding, memory: SampleMemory,
                     stops=()) -> list[list[Decoded]]:
    """Per question, every variant's tokens and fidelity (in `variants`' order), each variant compressed ONCE.

    `questions[q]`: the tokens read through each compressed cache before answering question q (empty: the question
    is the end of the prefilled prompt, as under with-question); `references[q]`: the full cache's answer to it.
    Under a total decode budget nothing evicts while a question is read, so that is refused by the caller."""
    from ripplekv.engine.divergence import decode_variants

    if decoding.total:
        raise ValueError("several questions from one compressed cache decode under prompt budgets only")
    questions = [list(question) for question in questions]
    prefilled = memory.weights + max(0, memory.meter.mark() - memory.meter.origin)
    if prefilled > memory.budget:
        note_prefill_over(state.length, prefilled, memory.budget)
    counts = []
    for variant in variants:  # a method's allocation is part of its build
        with timings.phase(timings.BUILD, variant.label):
            counts.append(variant.method.budgets(state, variant.budget))
    lengths = [[int(c) for c in count.max(1)] for count in counts]
    longest = max(references, key=lambda one: len(one.tokens))
    widest = max(questions, key=len)
    scorers = len({id(variant.method) for variant in variants})
    others = tensor_bytes([one for one in references if one is not longest])  # the other answers' log-probs
    room = variant_room(model, state, longest, [str(v) for v in variants], lengths, scorers, memory.budget,
                        len(widest), decoding.max_new_tokens) - others
    room = max(room // 2, 1)  # a group's built entries stay beside the cache each question copies them into
    results: list[list[Decoded | None]] = [[None] * len(variants) for _ in questions]
    for picked in fidelity_groups(model, state, lengths, longest, decoding.batch_size, widest, room,
                                  decoding.max_new_tokens):
        built = [build(state, variants[index], counts[index]) for index in picked]
        for asked, (question, reference) in enumerate(zip(questions, references)):
            tokens, quality = decode_variants(model, state, built, reference, decoding, stops, prefix=question,
                                              memory_bytes=room)
            for index, out, fid in zip(picked, tokens, quality):
                results[asked][index] = Decoded(variants[index], counts[index], out, fid)
        del built  # before the next group builds
    return results
