"""`ripplekv eval --protocol multi-question | multi-question-first`: one context, compressed once, asked k questions.

A sample of a multi-question task carries its questions (`questions`: a list of {input, answers}; the record's own
input and answers are the first). Its context is prefilled once and every (method, budget) variant compresses it
once (`engine.questions`); then each question is read through a copy of that compressed cache and answered:
- `multi-question`: the context alone is compressed (question-agnostic; its observation window is the end of the
  context), and every question, the first included, is read after it (as `context-only` reads its one question);
- `multi-question-first`: the first question's whole prompt is compressed (the first question in the observation
  window, as `with-question`), the first question is answered from it directly, and each follow-up's question part
  (the template after the context, with the chat template's closing) is read after that compressed prompt.
The full cache reads exactly the same tokens for every question, so each question's fidelity compares like with
like. Each question writes its own lines: `id` `<sample>#q<k>`, `context_id` the sample, `question_index` k (from
1) and `turn` "first" or "follow-up" (`analysis.follow_ups` reports the drop from the first to the follow-ups).
"""

from __future__ import annotations

from collections.abc import Sequence

from ripplekv.engine import decode as engine_decode
from ripplekv.engine import timings
from ripplekv.engine.prefill import Requirements
from ripplekv.engine.questions import decode_questions, question_references
from ripplekv.engine.recorders import SampleContext
from ripplekv.engine.schedule import SampleMemory, Variant, infeasible_variants
from ripplekv.errors import UserError
from ripplekv.methods.core.quantized import stored_as
from ripplekv.pipeline.sample_lines import SampleLines
from ripplekv.runs.files import REFERENCE

QUESTIONS = "questions"  # a multi-question record's field: every question asked of its context, the first first
FIRST, FOLLOW_UP = "first", "follow-up"


def question_records(task, record: dict) -> list[dict]:
    """The record as asked each of its questions (its input and answers replaced), in order; one line when it has
    fewer than two."""
    asked = record.get(QUESTIONS)
    if not isinstance(asked, list) or len(asked) < 2:
        raise UserError(f"record {record.get('_id', '?')} of {task.name} has no list of at least two questions "
                        f"({QUESTIONS!r}); --protocol multi-question runs tasks with several questions per "
                        "context (`ripplekv tasks` marks them)")
    return [{**record, "input": one["input"], "answers": list(one["answers"])} for one in asked]


def question_parts(task, record: dict, tokenizer, max_length: int, protocol: str):
    """(the tokens prefilled and compressed once, per question the tokens read through the compressed cache before
    its answer, the record as asked each question). The context is the first question's prompt up to its question
    (`prompts.question_start`); each question's part is the rest of its own prompt."""
    from ripplekv.tasks import build_prompt_ids
    from ripplekv.tasks.prompts import question_start

    records = question_records(task, record)
    tails, first, context = [], None, None
    for asked in records:
        ids = build_prompt_ids(task, asked, tokenizer, max_length)
        cut = question_start(task, asked, tokenizer, max_length)
        if first is None:
            first, context = list(ids), list(ids[:cut])
        if cut >= len(ids):
            raise UserError(f"{task.name}: the question of record {record.get('_id', '?')} cannot be found in its "
                            "prompt, so it cannot be asked after the context; this task cannot run multi-question")
        tails.append(list(ids[cut:]))
    if protocol == "multi-question-first":
        return first, [[], *tails[1:]], records
    return context, tails, records


def prefill(model, ids, needs: Requirements, reserve: int = 0, context: SampleContext | None = None):
    """The engine's prefill of a shared context (a module-level name, as `evaluate.prefill`, so tests can count it)."""
    from ripplekv.engine.prefill import prefill_for

    return prefill_for(model, ids, needs, reserve=reserve, context=context)


def evaluate_questions(model, tokenizer, task, record: dict, methods: dict, budgets: Sequence[int], settings, *,
                       sid: str, wanted, progress=None) -> list[dict]:
    """Result rows of one multi-question sample: per question, full first, then every other method at every budget,
    from ONE prefill and one compression per variant (`evaluate.evaluate_sample`'s contract otherwise)."""
    report = progress or (lambda kind, units: None)
    memory = SampleMemory(model, settings.memory_budget)
    decoding = settings.decoding_for(task)
    timings.declare(timings.PREFILL, timings.REFERENCE_DECODE, *decoding.phases)
    ids, questions, records = question_parts(task, record, tokenizer, settings.max_length, settings.protocol)
    with timings.phase(timings.PREFILL):
        state = prefill(model, ids, Requirements.of_all(methods.values()),
                                 reserve=max(map(len, questions)) + task.max_new_tokens,
                                 context=SampleContext(tokenizer, ()))
    report("prefill", state.length)
    stops = engine_decode.stop_tokens(model, tokenizer, task.stop_at_newline)
    references = question_references(model, state, questions, task.max_new_tokens, stops)
    report("decode", len(questions) * task.max_new_tokens)
    chosen_pairs = None if wanted.variants is None else set(wanted.variants)
    chosen = [Variant(label, budget, method) for label, method in methods.items() if label != REFERENCE
              for budget in budgets if chosen_pairs is None or (label, budget) in chosen_pairs]
    refused = infeasible_variants(chosen, state)
    chosen = [one for one in chosen if (one.label, one.budget) not in refused]
    answered = decode_questions(model, state, references, questions, chosen, decoding, memory, stops)
    report("decode", len(chosen) * len(questions) * task.max_new_tokens)
    rows = []
    for index, (asked, question, reference, decoded) in enumerate(zip(records, questions, references, answered), 1):
        lines = SampleLines.of(task, asked, tokenizer, f"{sid}#q{index}", state, question, settings.protocol,
                               memory.peak(), settings.decode_budget)
        lines.base = {"id": lines.base["id"], "context_id": sid, "question_index": index,
                      "turn": FIRST if index == 1 else FOLLOW_UP, **lines.base}
        rows += [lines.full(reference.tokens)] if wanted.with_full else []
        rows += [lines.line(one.variant.label, one.variant.budget, one.tokens, one.counts, one.fidelity.kl,
                            one.fidelity.agreement, one.capacity, stored_as(one.variant.method, state, one.variant.budget))
                 for one in decoded]
        rows += [lines.infeasible(label, budget, why) for (label, budget), why in refused.items()]
    return rows
