"""`ripplekv eval`: every sample prefilled once, every (method, budget) variant decoded from that prefill.

Per sample: build the prompt, prefill once, decode the full cache first (it is the reference), then
decode the compressed variants together in batches and measure their fidelity to the full cache along
the full cache's own answer. All of a sample's result lines are appended to `predictions.jsonl` and
fsynced together, so a killed run loses at most the sample in flight.

A rerun computes only the (sample, method, budget) lines that are missing: the same command resumes,
and more samples, tasks, methods or budgets grow the run. A sample that gains variants is prefilled
again (its full-cache answer is the fidelity reference and is recomputed, deterministically, but not
written twice). `config.json` pins what defines results (model, prompt lengths, method options, ...):
a run that differs in any of those never mixes into the directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

from ripplekv.defaults import BLOCKWISE_PROTOCOL, DEFAULT_BLOCK_TOKENS, EVAL_BATCH_SIZE, MULTI_QUESTION_PROTOCOLS
from ripplekv.engine import decode as engine_decode
from ripplekv.engine import timings
from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import SampleContext, record_reference
from ripplekv.engine.schedule import (
    DEFAULT_COMPRESS_EVERY,
    Decoding,
    SampleMemory,
    Variant,
    decode_variants,
    infeasible_variants,
)
from ripplekv.errors import UserError
from ripplekv.methods.core.quantized import stored_as
from ripplekv.pipeline.blockwise import blockwise_variants, check_blockwise_model
from ripplekv.pipeline.eval_plan import EvalSettings, Job, Plan, check_prompts_fit, plan_eval, plan_jobs
from ripplekv.pipeline.multi_question import evaluate_questions
from ripplekv.pipeline.run_config import check_run_dir, merge_config
from ripplekv.pipeline.sample_lines import SampleLines
from ripplekv.pipeline.samples import check_eval_sliding, check_eval_window, check_sliding_layers
from ripplekv.runs.files import CONFIG, PREDICTIONS, REFERENCE, REPORT_FILES, TIMINGS, report_is_current
from ripplekv.runs.resume import append_rows, existing_lines
from ripplekv.runs.safeio import exclusive, open_append, write_json
from ripplekv.runs.timings import TimingsLog

# --------------------------------------------------------------------------- one sample


def sample_id(record: dict, index: int, task) -> str:
    return str(record.get("_id") or f"{task.name}-{index}")


@dataclass(frozen=True)
class SampleSettings:
    """The settings of `ripplekv eval` that act inside one sample (`EvalSettings` has them all).

    `protocol`: "with-question" compresses the whole prompt (SnapKV's and KVCache-Factory's protocol);
    "context-only" prefills and compresses the context alone (its observation window is the end of the
    context; budgets count the context) and then reads the question through each compressed cache, as a
    cache reused across questions would (kvpress's default). Both come from one prefill. "multi-question" and
    "multi-question-first" ask one compressed context each of a sample's questions (`pipeline.multi_question`);
    "blockwise" prefills each variant block by block, `block_tokens` a block (`pipeline.blockwise`).
    `decoding`, `decode_budget`, `compress_every`, `batch_size`: how the variants decode (`schedule.Decoding`);
    under a total decode budget every line records `decode_budget` and `peak_entries` (the most entries a head
    held after a step, averaged over layers and KV heads).
    `memory_budget`: bytes the sample may hold (None: `memory.default_budget`); every line records
    `peak_memory_bytes` as `memory.PeakMemory` measures it. The prefill itself is not bounded.
    """

    max_length: int = 7500
    batch_size: int = EVAL_BATCH_SIZE
    protocol: str = "with-question"
    decoding: str = "divergence"
    decode_budget: str = "prompt"
    compress_every: int = DEFAULT_COMPRESS_EVERY
    memory_budget: int | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @classmethod
    def of(cls, settings: EvalSettings) -> SampleSettings:
        return cls(max_length=settings.max_length, batch_size=settings.batch_size, protocol=settings.protocol,
                   decode_budget=settings.decode_budget, memory_budget=settings.memory_budget,
                   compress_every=settings.compress_every or DEFAULT_COMPRESS_EVERY,
                   block_tokens=settings.block_tokens or DEFAULT_BLOCK_TOKENS)

    def decoding_for(self, task) -> Decoding:
        return Decoding(task.max_new_tokens, self.batch_size, self.decoding, self.decode_budget, self.compress_every)


@dataclass(frozen=True)
class Wanted:
    """Which rows of a sample to compute: `variants`, the (method, budget) pairs (None: every one; a run that grows
    computes only the missing ones), and the full row or not (`with_full=False`: already written; the full cache
    is still decoded, as the reference)."""

    variants: Sequence[tuple[str, int]] | None = None
    with_full: bool = True


def evaluate_sample(model, tokenizer, task, record: dict, methods: dict, budgets: Sequence[int],
                    settings: SampleSettings = SampleSettings(), *, sid: str, wanted: Wanted = Wanted(),
                    progress=None) -> list[dict]:
    """Result rows of one sample: full first, then every other method at every budget, from ONE prefill.

    The prompt is prefilled once (recording what `methods` declare they need), the full cache answers (the
    fidelity reference), then the engine decodes every variant (`schedule.decode_variants`: groups within the
    memory budget, each built when it decodes); `wanted` limits the rows computed.
    `progress(kind, units)` is called after the prefill ("prefill", prompt tokens) and after each decode
    ("decode", variants x max new tokens), for an ETA from work done.
    """
    if settings.protocol in MULTI_QUESTION_PROTOCOLS:  # one context, several questions: `pipeline.multi_question`
        return evaluate_questions(model, tokenizer, task, record, methods, budgets, settings, sid=sid, wanted=wanted,
                                  progress=progress)
    report = progress or (lambda kind, units: None)
    memory = SampleMemory(model, settings.memory_budget)  # its meter starts before the prefill
    decoding = settings.decoding_for(task)
    timings.declare(timings.PREFILL, timings.REFERENCE_DECODE, *decoding.phases)
    ids, question = prompt_parts(task, record, tokenizer, settings)
    sample = SampleContext(tokenizer, tuple(question), None if question else question_inside(task, record, tokenizer,
                                                                                          settings, len(ids)))
    with timings.phase(timings.PREFILL):  # its recorders count apart (`engine.timings`)
        state = prefill(model, ids, Requirements.of_all(methods.values()),
                        reserve=len(question) + task.max_new_tokens, context=sample)
    report("prefill", state.length)
    stops = engine_decode.stop_tokens(model, tokenizer, task.stop_at_newline)
    with timings.phase(timings.REFERENCE_DECODE):
        reference = engine_decode.full_reference(model, state, task.max_new_tokens, stops, prefix=question)
    record_reference(state, reference.tokens)  # kept only where a method declared it needs the answer
    report("decode", task.max_new_tokens)
    chosen_pairs = None if wanted.variants is None else set(wanted.variants)
    chosen = [Variant(label, budget, method) for label, method in methods.items() if label != REFERENCE
              for budget in budgets if chosen_pairs is None or (label, budget) in chosen_pairs]
    refused = infeasible_variants(chosen, state)  # the memory axis: over its bytes on this prompt, never decoded
    chosen = [one for one in chosen if (one.label, one.budget) not in refused]
    if settings.protocol == BLOCKWISE_PROTOCOL:  # one block-wise prefill per variant
        decoded, extra = blockwise_variants(model, ids, state, reference, chosen, decoding, memory, stops,
                                            settings.block_tokens)
    else:
        decoded, extra = decode_variants(model, state, reference, chosen, decoding, memory, stops, question), {}
    report("decode", len(chosen) * task.max_new_tokens)
    lines = SampleLines.of(task, record, tokenizer, sid, state, question, settings.protocol, memory.peak(),
                           settings.decode_budget)
    return ([lines.full(reference.tokens)] if wanted.with_full else []) + [
        lines.line(one.variant.label, one.variant.budget, one.tokens, one.counts, one.fidelity.kl,
                   one.fidelity.agreement, one.capacity, stored_as(one.variant.method, state, one.variant.budget))
        | extra.get((one.variant.label, one.variant.budget), {}) for one in decoded] + [lines.infeasible(label, budget, why) for (label, budget), why in refused.items()]


def prompt_parts(task, record: dict, tokenizer, settings: SampleSettings) -> tuple[list[int], list[int]]:
    """(the tokens prefilled and compressed, the question read after them through each compressed cache): the
    whole prompt and nothing under with-question; the context and the question under context-only."""
    from ripplekv.tasks import build_prompt_ids

    ids = build_prompt_ids(task, record, tokenizer, settings.max_length)
    if settings.protocol != "context-only":
        return ids, []
    from ripplekv.tasks.prompts import question_start

    cut = question_start(task, record, tokenizer, settings.max_length)
    return ids[:cut], list(ids[cut:])


def question_inside(task, record: dict, tokenizer, settings: SampleSettings, length: int) -> int | None:
    """Where the question part begins in a prompt compressed with its question (the task's own split, as
    context-only cuts it); None when the task's prompt has nothing after its context."""
    if settings.protocol == "context-only":
        return None
    from ripplekv.tasks.prompts import question_start

    cut = question_start(task, record, tokenizer, settings.max_length)
    return cut if 0 < cut < length else None


def prefill(model, ids, needs: Requirements, reserve: int = 0, context: SampleContext | None = None):
    """The engine's prefill (a module-level name so tests can prove a resumed run never calls it)."""
    from ripplekv.engine.prefill import prefill_for

    return prefill_for(model, ids, needs, reserve=reserve, context=context)


# --------------------------------------------------------------------------- the run


def load_all_samples(plan: Plan, tokenizer) -> list[tuple[object, str, dict]]:
    """(task, sample id, record) in run order: tasks in order, samples in file order."""
    from ripplekv.tasks import load_samples

    s = plan.settings
    work = []
    for task in plan.tasks:
        records = load_samples(task, tokenizer, split=s.split, limit=s.limit, data_dir=s.data_dir,
                               target_tokens=s.target_tokens, seed=s.seed)
        seen = set()
        for index, record in enumerate(records):
            sid = sample_id(record, index, task)
            if sid in seen:
                raise UserError(f"task {task.name} has two records with id {sid!r}; record ids must be unique")
            seen.add(sid)
            work.append((task, sid, record))
    if not work:
        raise UserError("no samples to evaluate: the chosen tasks have no records")
    return work


def check_model_fits(plan: Plan, config) -> None:
    """Per-layer budgets need the model's layer count (an allocation may not match), and a model with
    sliding-window layers the methods and decode budget that handle them (`config`: the model's): fail before
    loading weights."""
    from ripplekv.engine.packaged import names_bundled
    from ripplekv.methods.core.catalog import check_fitted

    layers = config.num_hidden_layers
    check_sliding_layers(config, {}, plan.settings.decode_budget)  # the methods once the prompts are known
    check_blockwise_model(config, plan.settings.protocol)
    check_fitted(plan.methods.values(), config, bundled=names_bundled(plan.settings.model))
    for method in plan.methods.values():
        if not method.prompt_dependent:
            method.layer_budgets(layers, plan.settings.budgets[0], plan.settings.budgets[0] + 1)


def sample_rows(settings: EvalSettings, methods: dict, budgets, loaded: tuple, job: Job,
                progress=None) -> tuple[list[dict], list[tuple[str, str, float]]]:
    """One unit of work: a sample with all its missing (method, budget) variants, on `loaded` = (model, tokenizer);
    returns its result lines and the seconds each phase took (`engine.timings`)."""
    model, tokenizer = loaded
    with timings.collect(next(model.parameters()).device) as spent:
        rows = evaluate_sample(model, tokenizer, job.task, job.record, methods, budgets, SampleSettings.of(settings),
                               sid=job.sid, wanted=Wanted(job.variants, job.with_full), progress=progress)
    return rows, spent.rows()


def run_samples(plan: Plan, jobs: list, budgets, tokenizer, workers, console, advance):
    """Yield `(job, (rows, phase seconds))` for every job: in this process (progress inside each sample through `advance`),
    or on Ray workers in finishing order (progress as each sample finishes)."""
    from functools import partial

    from ripplekv.engine.models import load_model
    from ripplekv.pipeline import distributed

    s = plan.settings
    if workers is None or not workers.uses_ray:
        model, _, _ = load_model(s.model, device=s.device, dtype=s.dtype)
        for job in jobs:
            yield job, sample_rows(s, plan.methods, budgets, (model, tokenizer), job, progress=advance)
        return
    device, dtype = plan.config["device"], plan.config["dtype"]
    setup = partial(distributed.load_model_on_worker, s.model, device, dtype)

    def retry(job, reason):
        console.print(f"[yellow]a worker died on {job.task.name}/{job.sid} ({reason}); running it again[/yellow]")

    for job, done in distributed.run_units(jobs, setup, partial(sample_rows, s, plan.methods, budgets), workers,
                                           device=device, on_retry=retry,
                                           label=lambda job: f"sample {job.task.name}/{job.sid}"):
        advance("prefill", job.prompt_tokens)
        advance("decode", job.decode_units)
        yield job, done


def run_eval(settings: EvalSettings, out: str | Path, console=None, notes: Sequence[str] = (), workers=None) -> dict:
    """Run, resume or grow an evaluation into `out`, then render its report; returns the report's tables.

    `notes` (where outputs go, which allocation) are printed once the input is known to be good, so
    bad input still ends in exactly one line. `workers` (a `distributed.Workers`) spreads the samples over
    Ray workers; this process still writes alone."""
    from rich.console import Console

    from ripplekv.engine.models import load_config, load_tokenizer

    console = console or Console(stderr=True)
    out = Path(out)
    from ripplekv.methods.core.spec import degenerate_notes

    plan = plan_eval(settings)
    notes = [*notes, *plan.notes, *degenerate_notes(plan.methods.values(), settings.budgets)]
    check_run_dir(out, plan.config)
    model_config = load_config(settings.model)  # read once, for every check below
    check_model_fits(plan, model_config)
    tokenizer = load_tokenizer(settings.model)
    work = load_all_samples(plan, tokenizer)
    check_eval_window(model_config, work, tokenizer, settings.max_length)  # a sliding window: refused before any model work
    check_eval_sliding(model_config, plan.methods, work, tokenizer, settings.max_length)
    check_prompts_fit(plan, work, tokenizer, model_config)
    config = {**plan.config, "samples": {}}
    for task, sid, _ in work:
        config["samples"].setdefault(task.name, []).append(sid)
    old = check_run_dir(out, config)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out, "eval"):  # two evals appending to one directory would duplicate lines
        for note in notes:
            console.print(note, soft_wrap=True, markup=False)
        return _run_locked(settings, out, plan, config, old, work, tokenizer, console, workers)


def _run_locked(settings, out: Path, plan: Plan, config: dict, old, work, tokenizer, console, workers=None) -> dict:
    """The part of `run_eval` that writes: only one process at a time per run directory."""
    import json

    import pandas as pd
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ripplekv.analysis import report
    from ripplekv.analysis.time_spent import time_table
    from ripplekv.pipeline.progress import Throughput, WorkClock, _eta_column

    have = existing_lines(out)
    times = TimingsLog(out / TIMINGS)  # a torn last row (a kill mid-write) is cut here
    times.settle(have)  # a sample's seconds staged before a stop: kept if its lines were written, else dropped
    times.mark_untimed(have)  # lines without rows (from an earlier version): said, not guessed
    jobs = plan_jobs(plan, config, work, have, tokenizer)
    merged = merge_config(old, config)
    unchanged = json.loads(json.dumps(merged)) == old
    if not jobs and unchanged and report_is_current(out):  # a resume with nothing to do: the report stands
        console.print(f"all {len(work)} samples already done in {out}; its report is up to date", soft_wrap=True)
        return {"leaderboard": pd.read_csv(out / "leaderboard.csv"), "time": time_table(out)}
    if not unchanged:  # an unchanged config keeps its file, whose time dates the report
        write_json(out / CONFIG, merged)
    written = []
    if jobs:
        again = [job for job in jobs if not job.with_full]
        fresh = len(jobs) - len(again)
        prefill_left = sum(job.prompt_tokens for job in jobs)
        decode_left = sum(job.decode_units for job in jobs)
        console.print(f"eval: {len(work)} samples ({len(work) - len(jobs)} done, {fresh} to run, "
                      f"{len(again)} to extend): {prefill_left} prompt tokens to prefill, "
                      f"up to {decode_left} tokens to decode", soft_wrap=True)
        if again:
            tokens = sum(job.prompt_tokens for job in again)
            console.print(f"extending {len(again)} finished samples with {sum(len(j.variants) for j in again)} "
                          f"new variants prefills them again ({tokens} tokens) and re-decodes their full-cache "
                          "reference (kept once in the file)", soft_wrap=True)
        clock = WorkClock(prefill_left, decode_left)
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[samples]}"),
                   Throughput("token"), TimeElapsedColumn(), _eta_column())
        finished = 0
        try:
            with Progress(*columns, console=console, transient=False) as progress, \
                    open_append(out / PREDICTIONS) as fh:
                bar = progress.add_task("eval", total=prefill_left + decode_left,
                                        samples=f"0/{len(jobs)} samples", deadline=None)

                def advance(kind: str, units: int) -> None:
                    clock.advance(kind, units)
                    eta = clock.eta()
                    progress.update(bar, advance=units, deadline=None if eta is None else clock.mark + eta)

                with closing(run_samples(plan, jobs, config["budgets"], tokenizer, workers, console, advance)) as results:
                    for job, (rows, spent) in results:  # in finishing order when workers run them
                        if job.old_prompt_tokens is not None and rows and rows[0]["prompt_tokens"] != job.old_prompt_tokens:
                            raise UserError(f"sample {job.task.name}/{job.sid} now has {rows[0]['prompt_tokens']} "
                                            f"prompt tokens, not {job.old_prompt_tokens} as in {out}; use a new --out directory")
                        times.stage(job.task.name, job.sid, spent, rows)  # kept through a stop before `commit`
                        append_rows(fh, rows)
                        times.commit()  # after its lines: a sample is timed once
                        finished += 1
                        progress.update(bar, samples=f"{finished}/{len(jobs)} samples",
                                        description=f"{job.task.name} [dim]{escape(job.sid)}[/dim] done")
        except KeyboardInterrupt:
            console.print(f"interrupted after {finished} of {len(jobs)} samples; "
                          "rerun the same command to resume")
            raise
        written.append(out / PREDICTIONS)
    else:
        console.print(f"all {len(work)} samples already done in {out}; re-rendering the report", soft_wrap=True)
    start = perf_counter()
    from ripplekv.methods.core.catalog import method_notes
    from ripplekv.methods.fit_records import run_fit_records

    tables = report.render(out, plots=report.plots_wanted(), notes=method_notes(), fits=run_fit_records(out))
    times.append("", "", [(timings.REPORT, "", perf_counter() - start)])
    written += [out / TIMINGS, out / CONFIG, *(out / name for name in REPORT_FILES if (out / name).exists())]
    console.print("wrote: " + ", ".join(str(path) for path in written), soft_wrap=True)
    return tables
