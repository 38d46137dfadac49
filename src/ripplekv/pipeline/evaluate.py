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

import hashlib
import json
import os
from collections.abc import Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ripplekv.defaults import DEFAULT_EVAL_METHODS
from ripplekv.engine.prefill import Requirements, captured_window
from ripplekv.errors import UserError
from ripplekv.methods.budgets import check_budget
from ripplekv.runs.files import CONFIG, EVAL_FILES, PREDICTIONS, REFERENCE, read_lines  # noqa: F401  (re-exported)
from ripplekv.runs.safeio import check_output, exclusive, other_files, write_json

PROTOCOLS = ("with-question", "context-only")
DEFAULT_METHODS = DEFAULT_EVAL_METHODS
# config.json keys a run may grow in: a rerun adds the missing lines and the union is recorded.
GROWABLE = ("budgets", "methods", "method_specs", "tasks", "limit", "samples")
# config.json keys that do not change results, so a rerun may differ in them (the allocation's hash
# is compared only when both runs have a method that reads --allocation; method specs, which hold the
# files' contents, are compared method by method; the capture window follows the methods, and queries
# captured beyond a method's window are never read).
NOT_COMPARED = ("ripplekv_version", "model", "model_location", "allocation", "allocation_sha256", "route",
                "route_sha256", "versions", "device_name", "capture_window", *GROWABLE)
# Keys that runs made before them lack: compared only when both configs have them. A model is the same
# model by its label and its weights' fingerprint, not by where its file lies (another checkout, another
# virtual environment), so a committed run can be grown anywhere.
RECORDED_LATER = ("model_sha256",)


@dataclass(frozen=True)
class EvalSettings:
    """What the user asked for, resolved (defaults filled in, lists parsed)."""

    budgets: tuple[int, ...]
    methods: tuple[str, ...] = DEFAULT_METHODS
    suite: str = "offline"
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    allocation: str | None = None
    model: str | None = None
    data_dir: str | None = None
    target_tokens: int = 3500
    max_length: int = 7500
    batch_size: int = 16
    seed: int = 0
    method_options: dict = field(default_factory=dict)
    route: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    protocol: str = "with-question"


def parse_names(text: str | Sequence[str] | None, option: str | None = None) -> tuple[str, ...]:
    """`"a,b, c"` (or several such strings) -> ('a', 'b', 'c'), duplicates dropped, order kept.

    With `option` (e.g. "--methods"), a given but empty list is a UserError rather than "none".
    """
    if text is None:
        return ()
    items = [text] if isinstance(text, str) else list(text)
    names = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
    if option and not names:
        raise UserError(f"{option} is empty; name at least one, comma-separated (or leave the option out)")
    return tuple(dict.fromkeys(names))


def parse_budgets(values: Sequence[str | int]) -> tuple[int, ...]:
    """`--budget 128 --budget 256,512` -> (128, 256, 512): positive integers, sorted, unique."""
    budgets = []
    for item in parse_names([str(v) for v in values]):
        try:
            number = int(item)
        except ValueError:
            raise UserError(f"budget must be a positive integer, got {item!r}") from None
        budgets.append(check_budget(number))
    if not budgets:
        raise UserError("give at least one --budget (average entries kept per layer per KV head), e.g. --budget 128")
    return tuple(sorted(set(budgets)))


def file_sha256(path: str | None) -> str | None:
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class Plan:
    """Everything checked before any model work: settings, tasks, methods, the run's config."""

    settings: EvalSettings
    tasks: list  # list[Task]
    methods: dict  # name -> Method, `full` first
    config: dict


def plan_eval(settings: EvalSettings) -> Plan:
    """Validate the user's input and build the config; raises UserError before any model is loaded."""
    from ripplekv import __version__
    from ripplekv.tasks import get_tasks
    from ripplekv.methods.catalog import build_methods
    from ripplekv.engine.models import (check_model_files, model_fingerprint, resolve_device_dtype, resolve_model,
                                        runtime_info)

    for budget in settings.budgets:
        check_budget(budget)
    if not settings.budgets:
        raise UserError("give at least one --budget, e.g. --budget 128")
    if settings.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {settings.batch_size}")
    if settings.protocol not in PROTOCOLS:
        raise UserError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {settings.protocol!r}")
    if not settings.methods:
        raise UserError("--methods is empty; name at least one method, e.g. --methods snapkv")
    if settings.limit is not None and settings.limit < 1:
        raise UserError(f"--limit must be at least 1, got {settings.limit}")
    if settings.target_tokens < 1:
        raise UserError(f"--target-tokens must be positive, got {settings.target_tokens}")
    if settings.max_length < 2:
        raise UserError(f"--max-length must be at least 2 tokens, got {settings.max_length}")
    # The full cache is always computed (it is the reference for fidelity), so it is always reported.
    shared = {**settings.method_options, "allocation": settings.allocation, "route": settings.route}
    methods = build_methods(settings.methods, shared)
    built = list(methods.values())
    names = tuple(methods)
    tasks = get_tasks(settings.suite, list(settings.tasks) or None)
    source = resolve_model(settings.model)
    device, dtype = resolve_device_dtype(settings.device, settings.dtype)
    allocation = settings.allocation if any("allocation" in m.describe().get("allocator", {}) for m in built) else None
    route = settings.route if any("route" in m.describe().get("scorer", {}) for m in built) else None
    check_model_files(settings.model)
    config = {
        "command": "eval",
        "budgets": list(settings.budgets),
        "methods": list(names),
        "method_specs": {label: method.describe() for label, method in methods.items()},
        "suite": settings.suite,
        "tasks": [task.name for task in tasks],
        "limit": settings.limit,
        "model": settings.model,
        "model_label": source.label,
        "model_location": source.location,
        "model_sha256": model_fingerprint(source),
        "data_dir": settings.data_dir,
        "target_tokens": settings.target_tokens,
        "max_length": settings.max_length,
        "batch_size": settings.batch_size,
        "seed": settings.seed,
        "capture_window": captured_window(Requirements.of_all(built)),
        "method_options": dict(sorted(settings.method_options.items())),
        "allocation": str(Path(allocation).resolve()) if allocation else None,
        "allocation_sha256": file_sha256(allocation),
        "route": str(Path(route).resolve()) if route else None,
        "route_sha256": file_sha256(route),
        "device": device,
        "dtype": dtype,
        "protocol": settings.protocol,
        **runtime_info(device),
        "ripplekv_version": __version__,
    }
    return Plan(settings=settings, tasks=tasks, methods=methods, config=config)


def _without_file_paths(spec: dict) -> dict:
    """A method spec without where its files were: their contents (multipliers, the route's methods) are
    recorded beside the paths and decide the output, so a run whose allocation moved (make reproduce's
    staging folder -> results/) can still be grown with the moved file."""
    from ripplekv.methods.presets import FILE_OPTIONS

    return {part: ({k: v for k, v in options.items() if k not in FILE_OPTIONS} if isinstance(options, dict) else options)
            for part, options in spec.items()}


def _differing(old: dict, new: dict, keys) -> list[str]:
    differing = [key for key in keys if key not in NOT_COMPARED and old.get(key) != new.get(key)
                 and not (key in RECORDED_LATER and key not in old)]
    # A method both runs name must be the same method: its resolved options (multipliers, route, ...) too.
    old_specs, new_specs = old.get("method_specs", {}), new.get("method_specs", {})
    changed = [label for label in set(old_specs) & set(new_specs)
               if _without_file_paths(old_specs[label]) != _without_file_paths(new_specs[label])]
    if changed:
        differing.append(f"options of {', '.join(sorted(changed))}")
    both_read_it = allocation_readers(old) & allocation_readers(new)
    if both_read_it and "allocation_sha256" in keys and old.get("allocation_sha256") != new.get("allocation_sha256"):
        differing.append("allocation_sha256")
    return differing


def allocation_readers(config: dict) -> set[str]:
    """The methods of a run that read its --allocation: their allocator takes an allocation that their own
    spec does not name (as the method specs in config.json record them)."""
    from ripplekv.methods import parse_spec

    specs = config.get("method_specs", {})
    return {label for label in config.get("methods", ())
            if "allocation" in specs.get(label, {}).get("allocator", {}) and "allocation" not in parse_spec(label)[1]}


def merge_config(old: dict | None, new: dict) -> dict:
    """The config of a run grown by `new`: union of budgets, methods, tasks and samples."""
    if old is None:
        return new
    merged = dict(new)
    merged["budgets"] = sorted(set(old["budgets"]) | set(new["budgets"]))
    merged["methods"] = list(dict.fromkeys([*old["methods"], *new["methods"]]))
    merged["method_specs"] = {**old.get("method_specs", {}), **new.get("method_specs", {})}
    merged["tasks"] = list(dict.fromkeys([*old["tasks"], *new["tasks"]]))
    limits = (old.get("limit"), new.get("limit"))
    merged["limit"] = None if None in limits else max(limits)
    samples = {task: list(ids) for task, ids in old.get("samples", {}).items()}
    for task, ids in new.get("samples", {}).items():
        samples[task] = list(dict.fromkeys([*samples.get(task, []), *ids]))
    merged["samples"] = samples
    if not allocation_readers(new):  # the allocation that made the old lines of the methods that read it
        merged["allocation"], merged["allocation_sha256"] = old.get("allocation"), old.get("allocation_sha256")
    return merged


# Everything `eval` writes into its run directory (plus report.render's files).
RUN_FILES = EVAL_FILES


def check_run_dir(out: Path, config: dict, keys=None) -> dict | None:
    """The existing config of `out` if it matches `config` on `keys`; a UserError naming the differences otherwise.

    `out` must be a writable directory that holds no inputs of the run, and either a new or empty one
    or an earlier `ripplekv eval` run: eval never writes into a folder holding anything else.
    """
    model = config.get("model_location") if str(config.get("model_location") or "").endswith(".gguf") else None
    check_output(out, kind="dir", inputs=[config.get("allocation"), config.get("route"), model], writes=RUN_FILES, run="eval")
    config_path, predictions = out / CONFIG, out / PREDICTIONS
    if not config_path.is_file():
        if predictions.exists():
            raise UserError(f"{out} holds {PREDICTIONS} but no {CONFIG}; use a new --out directory")
        foreign = other_files(out, RUN_FILES)
        if foreign:
            what = "a ripplekv profile" if "profile.json" in foreign else "other files (" + ", ".join(foreign[:3]) + ")"
            raise UserError(f"--out {out} holds {what}, not an eval run; pass a new or empty directory")
        return None
    if not predictions.is_file() or not predictions.read_bytes().strip():
        return None  # nothing computed yet: the new config simply replaces the old one
    try:
        old = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        raise UserError(f"{config_path} is unreadable; use a new --out directory") from None
    differing = _differing(old, config, keys if keys is not None else config.keys())
    if differing:
        raise UserError(
            f"{out} holds a run with a different configuration (differs in: {', '.join(differing)}); "
            "use a new --out directory (a run may only grow in budgets, methods, tasks and --limit)"
        )
    return old


# --------------------------------------------------------------------------- resuming


def variant_keys(config: dict) -> set[tuple[str, int | None]]:
    """The (method, budget) pairs every finished sample has: full once, every other method at every budget."""
    keys = {(REFERENCE, None)}
    keys.update((m, b) for m in config["methods"] if m != REFERENCE for b in config["budgets"])
    return keys


def existing_lines(out: Path) -> dict[tuple[str, str], dict]:
    """Per (task, id): the (method, budget) pairs already written and the prompt length they saw.

    Every complete line is a finished result and is kept, except after a kill mid-write (a trailing
    partial line): then the lines of the last sample written are cut off with it, so that sample is
    recomputed in one piece, exactly as an uninterrupted run would have written it.
    """
    path = out / PREDICTIONS
    rows, partial = read_lines(path)
    for number, row in enumerate(rows, 1):
        if not {"task", "id", "method", "budget"} <= set(row):
            raise UserError(f"{path}: result {number} lacks task, id, method or budget; "
                            "it was not written by `ripplekv eval`: use a new --out directory")
    if partial:
        data = path.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]
        last = (rows[-1]["task"], rows[-1]["id"]) if rows else None
        while rows and (rows[-1]["task"], rows[-1]["id"]) == last:
            rows.pop()
            keep = keep[: keep.rstrip(b"\n").rfind(b"\n") + 1]
        with path.open("r+b") as fh:
            fh.truncate(len(keep))
            fh.flush()
            os.fsync(fh.fileno())
    have: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = have.setdefault((row["task"], row["id"]), {"variants": set(), "prompt_tokens": row.get("prompt_tokens")})
        entry["variants"].add((row["method"], row["budget"]))
    return have


def append_rows(fh, rows: list[dict]) -> None:
    """One sample's lines in one write, flushed to disk before the next sample starts."""
    fh.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    fh.flush()
    os.fsync(fh.fileno())


# --------------------------------------------------------------------------- one sample


def sample_id(record: dict, index: int, task) -> str:
    return str(record.get("_id") or f"{task.name}-{index}")


def evaluate_sample(
    model,
    tokenizer,
    task,
    record: dict,
    methods: dict,
    budgets: Sequence[int],
    *,
    sid: str,
    max_length: int = 7500,
    batch_size: int = 16,
    needs: Requirements | None = None,
    variants: Sequence[tuple[str, int]] | None = None,
    with_full: bool = True,
    progress=None,
    protocol: str = "with-question",
    decoding: str = "divergence",
) -> list[dict]:
    """Result rows of one sample: full first, then every other method at every budget, from ONE prefill.

    `variants` limits the compressed (method, budget) pairs computed (a run that grows computes only
    the missing ones); `with_full=False` leaves out the full row (already written; it is still decoded,
    as the fidelity reference). `progress(kind, units)` is called after the prefill ("prefill", prompt
    tokens) and after each decode ("decode", variants x max new tokens), for an ETA from work done.

    `needs`: what the prefill records; by default the union of what `methods` declare.

    `protocol`: "with-question" compresses the whole prompt (SnapKV's and KVCache-Factory's protocol);
    "context-only" prefills and compresses the context alone (its observation window is the end of the
    context; budgets count the context) and then reads the question through each compressed cache, as a
    cache reused across questions would (kvpress's default). Both come from one prefill.

    `decoding`: "divergence" decodes a variant only after its first disagreement with the full answer
    (`engine.divergence`); "plain" decodes every variant whole (the same tokens, floating-point ties aside).
    """
    report = progress or (lambda kind, units: None)
    from ripplekv.tasks import build_prompt_ids
    from ripplekv.engine.decode import full_reference, stop_tokens
    from ripplekv.engine.divergence import decode_variants
    from ripplekv.metrics.scoring import score_sample

    ids = build_prompt_ids(task, record, tokenizer, max_length)
    question: list[int] = []
    if protocol == "context-only":
        from ripplekv.tasks.prompts import question_start

        cut = question_start(task, record, tokenizer, max_length)
        ids, question = ids[:cut], list(ids[cut:])
    needs = Requirements.of_all(methods.values()) if needs is None else needs
    state = prefill(model, ids, needs=needs, reserve=len(question) + task.max_new_tokens)
    n, layers, heads = state.length, state.num_layers, state.num_kv_heads
    report("prefill", n)
    stops = stop_tokens(model, tokenizer, task.stop_at_newline)
    reference = full_reference(model, state, task.max_new_tokens, stops, prefix=question)
    state.answer, state.prefix = list(reference.tokens), list(question)  # for the answer-aware oracle only
    state.tokenizer = tokenizer  # for scorers that phrase a request to the model (KVzip)
    report("decode", task.max_new_tokens)

    wanted = None if variants is None else set(variants)
    variants = [(label, budget, method) for label, method in methods.items() if label != REFERENCE for budget in budgets
                if wanted is None or (label, budget) in wanted]
    counts = [method.budgets(state, budget) for _, budget, method in variants]
    built = [method.compress(state, budget) for _, budget, method in variants]
    tokens, quality = decode_variants(model, state, built, reference, task.max_new_tokens, stops, prefix=question,
                                      batch_size=batch_size, decoding=decoding)
    report("decode", len(built) * task.max_new_tokens)

    base = {
        "id": sid,
        "task": task.name,
        "category": task.category,
        "prompt_tokens": n + len(question),
        "compressed_tokens": n,
        "protocol": protocol,
        "length": record.get("length"),
        "answers": list(record["answers"]),
    }
    if record.get("all_classes"):  # classification tasks: `ripplekv score` needs the class names to rescore
        base["all_classes"] = list(record["all_classes"])

    def row(name, budget, out_tokens, entry_counts, kl, agreement):
        prediction = tokenizer.decode(out_tokens, skip_special_tokens=True)
        score = score_sample(task, prediction, record["answers"], record.get("all_classes"))
        per_layer = entry_counts.sum(1)
        fields = {
            **base,
            "method": name,
            "budget": budget,
            "prediction": prediction,
            "new_tokens": len(out_tokens),
            "score": float(score),
            "kept_entries": int(entry_counts.sum()),
            "kl": float(kl),
            "agreement": float(agreement),
            # Entries per KV head in each layer (the mean over heads when heads differ; then head_budgets too).
            "layer_budgets": [int(t) // heads if t % heads == 0 else round(float(t) / heads, 3) for t in per_layer],
        }
        if bool((entry_counts != entry_counts[:, :1]).any()):
            fields["head_budgets"] = entry_counts.tolist()
        return fields

    full_counts = np.full((layers, heads), n, dtype=np.int64)
    rows = [row(REFERENCE, None, reference.tokens, full_counts, 0.0, 1.0)] if with_full else []
    for (name, budget, _), entry_counts, entry_list, out_tokens, fid in zip(variants, counts, built, tokens, quality):
        kept = np.array([[int(c) for c in layer.counts.tolist()] for layer in entry_list], dtype=np.int64)
        assert (kept == entry_counts).all(), f"{name}@{budget}: built entries differ from the allocated budgets"
        rows.append(row(name, budget, out_tokens, kept, fid.kl, fid.agreement))
    return rows


def prefill(model, ids, needs: Requirements, reserve: int = 0):
    """The engine's prefill (a module-level name so tests can prove a resumed run never calls it)."""
    from ripplekv.engine.prefill import prefill_for

    return prefill_for(model, ids, needs, reserve=reserve)


# --------------------------------------------------------------------------- the run


def load_all_samples(plan: Plan, tokenizer) -> list[tuple[object, str, dict]]:
    """(task, sample id, record) in run order: tasks in order, samples in file order."""
    from ripplekv.tasks import load_samples

    s = plan.settings
    work = []
    for task in plan.tasks:
        records = load_samples(task, tokenizer, limit=s.limit, data_dir=s.data_dir,
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


def check_model_fits(plan: Plan) -> None:
    """Per-layer budgets need the model's layer count (an allocation may not match): fail before loading weights."""
    from ripplekv.engine.models import load_config

    layers = load_config(plan.settings.model).num_hidden_layers
    for method in plan.methods.values():
        if not method.prompt_dependent:
            method.layer_budgets(layers, plan.settings.budgets[0], plan.settings.budgets[0] + 1)


def sample_rows(settings: EvalSettings, methods: dict, budgets, loaded: tuple, job: "Job", progress=None) -> list[dict]:
    """One unit of work: a sample with all its missing (method, budget) variants, on `loaded` = (model, tokenizer)."""
    model, tokenizer = loaded
    return evaluate_sample(model, tokenizer, job.task, job.record, methods, budgets, sid=job.sid,
                           max_length=settings.max_length, batch_size=settings.batch_size,
                           variants=job.variants, with_full=job.with_full,
                           progress=progress, protocol=settings.protocol)


def run_samples(plan: Plan, jobs: list, budgets, tokenizer, workers, console, advance):
    """Yield `(job, rows)` for every job: in this process (progress inside each sample through `advance`),
    or on Ray workers in finishing order (progress as each sample finishes)."""
    from functools import partial

    from ripplekv.pipeline import distributed
    from ripplekv.engine.models import load_model

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

    for job, rows in distributed.run_units(jobs, setup, partial(sample_rows, s, plan.methods, budgets), workers,
                                           device=device, on_retry=retry,
                                           label=lambda job: f"sample {job.task.name}/{job.sid}"):
        advance("prefill", job.prompt_tokens)
        advance("decode", job.decode_units)
        yield job, rows


def run_eval(settings: EvalSettings, out: str | Path, console=None, notes: Sequence[str] = (), workers=None) -> dict:
    """Run, resume or grow an evaluation into `out`, then render its report; returns the report's tables.

    `notes` (where outputs go, which allocation) are printed once the input is known to be good, so
    bad input still ends in exactly one line. `workers` (a `distributed.Workers`) spreads the samples over
    Ray workers; this process still writes alone."""
    from rich.console import Console

    from ripplekv.engine.models import load_tokenizer

    console = console or Console(stderr=True)
    out = Path(out)
    from ripplekv.methods.presets import degenerate_notes

    plan = plan_eval(settings)
    notes = [*notes, *degenerate_notes(plan.methods.values(), settings.budgets)]
    check_run_dir(out, plan.config)
    check_model_fits(plan)
    tokenizer = load_tokenizer(settings.model)
    work = load_all_samples(plan, tokenizer)
    config = {**plan.config, "samples": {}}
    for task, sid, _ in work:
        config["samples"].setdefault(task.name, []).append(sid)
    old = check_run_dir(out, config)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out, "eval"):  # two evals appending to one directory would duplicate lines
        for note in notes:
            console.print(note, soft_wrap=True, markup=False)
        return _run_locked(settings, out, plan, config, old, work, tokenizer, console, workers)


@dataclass
class Job:
    """One sample's missing work: which variants, whether its full row is new, its prompt length."""

    task: object
    sid: str
    record: dict
    variants: list[tuple[str, int]]
    with_full: bool
    prompt_tokens: int
    old_prompt_tokens: int | None

    @property
    def decode_units(self) -> int:
        # The full cache is decoded again even when its row exists: it is the fidelity reference.
        return (1 + len(self.variants)) * self.task.max_new_tokens


def plan_jobs(plan: Plan, config: dict, work, have: dict, tokenizer) -> list[Job]:
    """What is missing from the run directory for this command's samples and variants."""
    from ripplekv.tasks import build_prompt_ids

    wanted = sorted(variant_keys(config) - {(REFERENCE, None)})
    jobs = []
    for task, sid, record in work:
        entry = have.get((task.name, sid), {"variants": set(), "prompt_tokens": None})
        missing = [key for key in wanted if key not in entry["variants"]]
        with_full = (REFERENCE, None) not in entry["variants"]
        if missing or with_full:
            n = len(build_prompt_ids(task, record, tokenizer, plan.settings.max_length))
            jobs.append(Job(task, sid, record, missing, with_full, n, entry["prompt_tokens"]))
    return jobs


class WorkClock:
    """ETA from work done: seconds per prefilled token and per decoded token (max new tokens x variants),
    each measured on this run, times the work left of each kind."""

    def __init__(self, prefill_left: int, decode_left: int):
        import time

        self._now = time.monotonic
        self.left = {"prefill": prefill_left, "decode": decode_left}
        self.done = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.mark = self._now()

    def advance(self, kind: str, units: int) -> None:
        now = self._now()
        self.seconds[kind] += now - self.mark
        self.mark = now
        self.done[kind] += units
        self.left[kind] = max(0, self.left[kind] - units)

    def eta(self) -> float | None:
        """Seconds left, or None until both kinds of work have been timed once."""
        if any(self.left[k] and not self.done[k] for k in self.left):
            return None
        return sum(self.left[k] * self.seconds[k] / self.done[k] for k in self.left if self.left[k])


def _clock_text(seconds: float | None) -> str:
    if seconds is None:
        return "measuring"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _eta_column():
    """Counts down from the last estimate between updates (which come only at phase boundaries)."""
    import time

    from rich.progress import ProgressColumn
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        def render(self, task):
            deadline = task.fields.get("deadline")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return Text("ETA " + _clock_text(left))

    return EtaColumn()


def _run_locked(settings, out: Path, plan: Plan, config: dict, old, work, tokenizer, console, workers=None) -> dict:
    """The part of `run_eval` that writes: only one process at a time per run directory."""
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ripplekv.analysis import report
    from ripplekv.pipeline.progress import Throughput

    have = existing_lines(out)
    jobs = plan_jobs(plan, config, work, have, tokenizer)
    write_json(out / CONFIG, merge_config(old, config))
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
                    (out / PREDICTIONS).open("a", encoding="utf-8") as fh:
                bar = progress.add_task("eval", total=prefill_left + decode_left,
                                        samples=f"0/{len(jobs)} samples", deadline=None)

                def advance(kind: str, units: int) -> None:
                    clock.advance(kind, units)
                    eta = clock.eta()
                    progress.update(bar, advance=units, deadline=None if eta is None else clock.mark + eta)

                with closing(run_samples(plan, jobs, config["budgets"], tokenizer, workers, console, advance)) as results:
                    for job, rows in results:  # in finishing order when workers run them
                        if job.old_prompt_tokens is not None and rows and rows[0]["prompt_tokens"] != job.old_prompt_tokens:
                            raise UserError(f"sample {job.task.name}/{job.sid} now has {rows[0]['prompt_tokens']} "
                                            f"prompt tokens, not {job.old_prompt_tokens} as in {out}; use a new --out directory")
                        append_rows(fh, rows)
                        finished += 1
                        progress.update(bar, samples=f"{finished}/{len(jobs)} samples",
                                        description=f"{job.task.name} [dim]{escape(job.sid)}[/dim] done")
        except KeyboardInterrupt:
            console.print(f"interrupted after {finished} of {len(jobs)} samples; "
                          "rerun the same command to resume")
            raise
        written.append(out / PREDICTIONS)
    else:
        console.print(f"all {len(work)} samples already done in {out}; re-rendering the report")
    tables = report.render(out)
    written += [out / CONFIG, *(out / name for name in report.REPORT_FILES if (out / name).exists())]
    console.print("wrote: " + ", ".join(str(path) for path in written), soft_wrap=True)
    return tables
