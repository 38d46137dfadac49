"""One compressed context, many questions: every variant is built once and answers every question together.

Serving prefills a long context once, caches it, and asks it many questions (prefix caching, multi-turn chat,
agents). Here the context is prefilled once (`PrefillState`), every (method, budget) variant compresses it once,
and the questions' tokens are read through fresh caches made from those same entries (`build_lazily` copies
entries into a cache, so the entries themselves are never changed and serve every question):
- the full cache answers every question first (its references): one forward reads all the questions, and one
  decoding step advances every answer, its logits giving the answer's log-probs (`question_references`);
- the variants are cut into groups by kept length (`decode.fidelity_groups`, planned for the longest question and
  answer, each variant counted once per question it carries), a group's entries are built once, and its cache
  holds a row for every (variant, question): one forced pass reads every question along its own reference through
  every variant, and the rows that leave their reference decode on together (`divergence.diverge_rows`).
  Under plain decoding (the check on divergence decoding) a group answers the questions one after another.
Each question's tokens and fidelity are what it gets asked alone up to floating-point ties (the rows of a batch
are other products of the same numbers). A group holds its built entries beside its cache, so groups are planned
within half the bytes left (`memory.variant_room`). Nothing of the context is prefilled again, and an extra
question adds rows to passes that run anyway, not passes: `scripts/bench_questions.py` measures what it costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ripplekv.engine import timings
from ripplekv.engine.cache import build_cache, build_lazily
from ripplekv.engine.decode import Reference, fidelity_groups, forward_tokens
from ripplekv.engine.divergence import DivergenceResult, decode_variants, diverge_rows, greedy_rows, hide
from ripplekv.engine.memory import StepCosts, tensor_bytes, variant_room
from ripplekv.engine.prefill import PrefillState
from ripplekv.engine.schedule import Decoded, Decoding, SampleMemory, Variant, build, planned_counts


@torch.inference_mode()
def question_references(model, state: PrefillState, questions: Sequence[Sequence[int]], max_new_tokens: int,
                        stops=()) -> list[Reference]:
    """The full cache's answer to each question (read after the prefilled context) and its log-probs, in order:
    every question in one batch, so one forward reads them all and each decoding step advances every answer.

    The log-probs are the decoding's own logits at each answer position (the full cache is never forced along its
    own greedy answer: that pass would compute the same distributions again, the shared part in one forward
    instead of a step at a time, so its last bits may differ from these). An empty question answers from the
    prefill's last logits (the question ended the prompt)."""
    questions = [list(question) for question in questions]
    stop = {int(t) for t in stops}
    with timings.phase(timings.REFERENCE_DECODE):
        cache = build_cache(state, None, len(questions))
        width = max(map(len, questions))
        if width:  # the questions right-padded to the longest: the padding is hidden from the answers below
            fed = torch.tensor([q + [0] * (width - len(q)) for q in questions], dtype=torch.long, device=state.device)
            ends = sorted({len(q) - 1 for q in questions if q})
            read = forward_tokens(model, cache, fed, state.length, torch.tensor(ends, device=state.device))
        firsts = [read[row, ends.index(len(q) - 1)] if q else state.last_logits.float()
                  for row, q in enumerate(questions)]
        logprobs = [[torch.log_softmax(first, -1)] for first in firsts]
        result = DivergenceResult(tokens=[[int(first.argmax())] for first in firsts], fidelity=[])
        rows = [row for row, tokens in enumerate(result.tokens) if tokens[0] not in stop and max_new_tokens > 1]
        if rows:
            if len(rows) < len(questions):
                cache.select_variants(torch.tensor(rows, dtype=torch.long, device=state.device), in_place=True)
            if width:
                hidden = torch.zeros(len(rows), width, dtype=torch.float32, device=state.device)
                for at, row in enumerate(rows):
                    hidden[at, len(questions[row]) :] = float("-inf")
                hide(cache, hidden)

            def record(running, logits):
                for row, step in zip(running, torch.log_softmax(logits, -1)):
                    logprobs[row].append(step)

            greedy_rows(model, cache, rows, [state.length + len(questions[row]) for row in rows], result,
                        max_new_tokens, stop, record)
        return [Reference(tokens, torch.stack(steps)) for tokens, steps in zip(result.tokens, logprobs)]


@torch.inference_mode()
def decode_questions(model, state: PrefillState, references: Sequence[Reference], questions: Sequence[Sequence[int]],
                     variants: Sequence[Variant], decoding: Decoding, memory: SampleMemory,
                     stops=()) -> list[list[Decoded]]:
    """Per question, every variant's tokens and fidelity (in `variants`' order), each variant compressed ONCE.

    `questions[q]`: the tokens read through each compressed cache before answering question q (empty: the question
    is the end of the prefilled prompt, as under with-question); `references[q]`: the full cache's answer to it.
    Under a total decode budget nothing evicts while a question is read, so that is refused by the caller."""
    if decoding.total:
        raise ValueError("several questions from one compressed cache decode under prompt budgets only")
    questions = [list(question) for question in questions]
    counts, lengths = planned_counts(state, variants, memory)
    longest = max(references, key=lambda one: len(one.tokens))
    widest = max(questions, key=len)
    scorers = len({id(variant.method) for variant in variants})
    others = tensor_bytes([one for one in references if one is not longest])  # the other answers' log-probs
    room = variant_room(model, state, longest, [str(v) for v in variants], lengths, scorers, memory.budget,
                        len(widest), decoding.max_new_tokens) - others
    room = max(room // 2, 1)  # a group's built entries stay beside the cache the questions copy them into
    together = 1 if decoding.decoding == "plain" else _questions_together(model, state, lengths, longest, widest,
                                                                           len(questions), decoding, room)
    results: list[list[Decoded | None]] = [[None] * len(variants) for _ in questions]
    for picked in fidelity_groups(model, state, lengths, longest, max(1, decoding.batch_size // together), widest,
                                  max(room // together, 1), decoding.max_new_tokens):  # a variant: `together` rows
        built = [build(state, variants[index], counts[index]) for index in picked]
        if together == 1:
            answered = ([decode_variants(model, state, built, reference, decoding, stops, prefix=question,
                                         memory_bytes=room)] for question, reference in zip(questions, references))
        else:
            answered = _asked_together(model, state, built, [lengths[i] for i in picked], questions, references,
                                       together, decoding.max_new_tokens, stops)
        asked = 0
        for tokens, quality in (one for chunk in answered for one in chunk):
            for index, out, fid in zip(picked, tokens, quality):
                results[asked][index] = Decoded(variants[index], counts[index], out, fid)
            asked += 1
        del built  # before the next group builds
    return results


def _questions_together(model, state, lengths, longest: Reference, widest, count: int, decoding: Decoding,
                        room: int) -> int:
    """How many questions one pass reads through a group: all of them, within the batch size and as many rows of
    the largest variant as `room` holds (at least one)."""
    fed = max(1, len(widest) + len(longest.tokens) - 1)
    costs = StepCosts.of(model, state)
    row = max(costs.group(1, length, fed, fed + decoding.max_new_tokens) for length in lengths)
    return max(1, min(count, decoding.batch_size, room // row))


def _asked_together(model, state, built, lengths, questions, references, together: int, max_new_tokens: int, stops):
    """Per chunk of `together` questions, per question (tokens per variant, fidelity per variant) of the `built`
    variants: one cache holds a row for every (variant, question), so a forced pass reads every question through
    every variant's cache and each decoding step advances all of them (`divergence.diverge_rows`)."""
    stop = {int(t) for t in stops}
    for first in range(0, len(questions), together):
        chunk = range(first, min(first + together, len(questions)))
        rows = [(variant, asked) for variant in range(len(built)) for asked in chunk]  # variant-major
        with timings.phase(timings.TEACHER_FORCED):
            cache = build_lazily(state, (built[variant] for variant, _ in rows), [lengths[v] for v, _ in rows])
        result = DivergenceResult(tokens=[None] * len(rows), fidelity=[None] * len(rows))
        diverge_rows(model, state, cache, [(questions[asked], references[asked]) for _, asked in rows],
                     list(range(len(rows))), result, max_new_tokens, stop)
        del cache
        yield [([result.tokens[row * len(chunk) + at] for row in range(len(built))],
                [result.fidelity[row * len(chunk) + at] for row in range(len(built))]) for at in range(len(chunk))]
