"""`ripplekv eval`: every sample prefilled once, every (method, budget) variant decoded from that prefill.

Per sample: build the prompt, prefill once, decode the full cache first (it is the reference), then
decode the compressed variants together in batches and measure their fidelity to the full cache along
the full cache's own answer. All of a sample's result lines are appended to `predictions.jsonl` and
fsynced together, so a killed run loses at most the sample in flight and a rerun of the same command
resumes where it stopped without recomputing anything. `config.json` pins what the run directory holds:
a different configuration never mixes into it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ripplekv.budgets import check_budget
from ripplekv.errors import UserError
from ripplekv.runfiles import CONFIG, PREDICTIONS, REFERENCE, read_lines  # noqa: F401  (re-exported)

DEFAULT_METHODS = ("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")
# config.json keys that do not change results, so a rerun may differ in them.
NOT_COMPARED = ("ripplekv_version", "model", "allocation", "route", "versions", "device_name")


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
    capture_window: int = 64
    method_options: dict = field(default_factory=dict)
    route: str | None = None
    device: str = "auto"
    dtype: str = "auto"


def parse_names(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """`"a,b, c"` (or several such strings) -> ('a', 'b', 'c'), duplicates dropped, order kept."""
    if text is None:
        return ()
    items = [text] if isinstance(text, str) else list(text)
    names = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
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
    from ripplekv.data import get_tasks
    from ripplekv.methods import make_method
    from ripplekv.methods.presets import shared_option_users
    from ripplekv.models import resolve_device_dtype, resolve_model, runtime_info

    for budget in settings.budgets:
        check_budget(budget)
    if not settings.budgets:
        raise UserError("give at least one --budget, e.g. --budget 128")
    if settings.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {settings.batch_size}")
    if settings.limit is not None and settings.limit < 1:
        raise UserError(f"--limit must be at least 1, got {settings.limit}")
    if settings.target_tokens < 1:
        raise UserError(f"--target-tokens must be positive, got {settings.target_tokens}")
    if settings.max_length < 2:
        raise UserError(f"--max-length must be at least 2 tokens, got {settings.max_length}")
    if not settings.methods:
        raise UserError("--methods is empty; name at least one method, e.g. --methods snapkv,pyramidkv")
    # The full cache is always computed (it is the reference for fidelity), so it is always reported.
    shared = {**settings.method_options, "allocation": settings.allocation, "route": settings.route}
    built = [make_method(spec, shared=shared) for spec in (REFERENCE, *settings.methods)]
    for key, used in shared_option_users(settings.methods, shared).items():
        if not used:
            raise UserError(f"--{key} applies to none of the chosen methods ({', '.join(settings.methods)})")
    methods = {method.label: method for method in built}
    names = tuple(methods)
    tasks = get_tasks(settings.suite, list(settings.tasks) or None)
    source = resolve_model(settings.model)
    device, dtype = resolve_device_dtype(settings.device, settings.dtype)
    allocation = settings.allocation if any("allocation" in m.describe().get("allocator", {}) for m in built) else None
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
        "data_dir": settings.data_dir,
        "target_tokens": settings.target_tokens,
        "max_length": settings.max_length,
        "batch_size": settings.batch_size,
        "seed": settings.seed,
        "capture_window": settings.capture_window,
        "method_options": dict(sorted(settings.method_options.items())),
        "allocation": str(Path(allocation).resolve()) if allocation else None,
        "allocation_sha256": file_sha256(allocation),
        "device": device,
        "dtype": dtype,
        **runtime_info(device),
        "ripplekv_version": __version__,
    }
    return Plan(settings=settings, tasks=tasks, methods=methods, config=config)


def _differing(old: dict, new: dict, keys) -> list[str]:
    return [key for key in keys if key not in NOT_COMPARED and old.get(key) != new.get(key)]


def check_run_dir(out: Path, config: dict, keys=None) -> dict | None:
    """The existing config of `out` if it matches `config` on `keys`; a UserError naming the differences otherwise."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    config_path, predictions = out / CONFIG, out / PREDICTIONS
    if not config_path.is_file():
        if predictions.exists():
            raise UserError(f"{out} holds {PREDICTIONS} but no {CONFIG}; use a new --out directory")
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
            "use a new --out directory, or rerun with the same options to resume"
        )
    return old


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- resuming


def variant_keys(config: dict) -> set[tuple[str, int | None]]:
    """The (method, budget) pairs every finished sample has: full once, every other method at every budget."""
    keys = {(REFERENCE, None)}
    keys.update((m, b) for m in config["methods"] if m != REFERENCE for b in config["budgets"])
    return keys


def finished_samples(out: Path, config: dict) -> set[tuple[str, str]]:
    """(task, id) of samples with every variant written; rewrites the file without any unfinished sample.

    Lines of one sample are written together, so only the sample in flight at a kill can be unfinished;
    it is dropped (with any trailing partial line) and recomputed.
    """
    path = out / PREDICTIONS
    rows, partial = read_lines(path)
    expected = variant_keys(config)
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["id"]), []).append(row)
    done = {
        key for key, group in groups.items()
        if len(group) == len(expected) and {(r["method"], r["budget"]) for r in group} == expected
    }
    kept = [row for row in rows if (row["task"], row["id"]) in done]
    if partial or len(kept) != len(rows):
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return done


@contextmanager
def exclusive_run(out: Path):
    """Hold `out/.lock` for the whole run: two evals appending to one directory would duplicate lines."""
    handle = (out / ".lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(f"another ripplekv eval is writing to {out}; wait for it to finish or use another --out") from None
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def append_rows(fh, rows: list[dict]) -> None:
    """One sample's lines in one write, flushed to disk before the next sample starts."""
    fh.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    fh.flush()
    os.fsync(fh.fileno())


# --------------------------------------------------------------------------- one sample


def stop_ids(task, tokenizer, model) -> list[int]:
    """EOS id(s) of tokenizer and generation config, plus the newline for stop-at-newline tasks (as pred.py)."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (tokenizer.eos_token_id, getattr(generation, "eos_token_id", None)):
        if source is None:
            continue
        ids.update(int(t) for t in (source if isinstance(source, (list, tuple)) else [source]))
    if task.stop_at_newline:
        ids.add(int(tokenizer.encode("\n", add_special_tokens=False)[-1]))
    return sorted(ids)


def sample_id(record: dict, index: int, task) -> str:
    return str(record.get("_id") or f"{task.name}-{index}")


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


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
    capture_window: int = 64,
) -> list[dict]:
    """Result rows of one sample: full first, then every other method at every budget, from ONE prefill."""
    from ripplekv.data import build_prompt_ids
    from ripplekv.decode import full_reference, greedy_decode, measure_fidelity
    from ripplekv.metrics import score_sample

    ids = build_prompt_ids(task, record, tokenizer, max_length)
    state = prefill(model, ids, capture_window=capture_window, reserve=task.max_new_tokens)
    n, layers, heads = state.length, state.num_layers, state.num_kv_heads
    reference = full_reference(model, state, task.max_new_tokens, stop_ids(task, tokenizer, model))

    variants = [(label, budget, method) for label, method in methods.items() if label != REFERENCE for budget in budgets]
    counts = [method.budgets(state, budget) for _, budget, method in variants]
    built = [method.compress(state, budget) for _, budget, method in variants]
    tokens: list[list[int]] = []
    for batch in _chunks(built, batch_size):
        tokens.extend(greedy_decode(model, state, batch, task.max_new_tokens, stop_ids(task, tokenizer, model)))
    quality = measure_fidelity(model, state, built, reference, batch_size)

    base = {
        "id": sid,
        "task": task.name,
        "category": task.category,
        "prompt_tokens": n,
        "length": record.get("length"),
        "answers": list(record["answers"]),
    }

    def row(name, budget, out_tokens, entry_counts, kl, agreement):
        prediction = tokenizer.decode(out_tokens, skip_special_tokens=True)
        score = score_sample(task.name, prediction, record["answers"], record.get("all_classes"))
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
    rows = [row(REFERENCE, None, reference.tokens, full_counts, 0.0, 1.0)]
    for (name, budget, _), entry_counts, entry_list, out_tokens, fid in zip(variants, counts, built, tokens, quality):
        kept = np.array([[int(c) for c in layer.counts.tolist()] for layer in entry_list], dtype=np.int64)
        assert (kept == entry_counts).all(), f"{name}@{budget}: built entries differ from the allocated budgets"
        rows.append(row(name, budget, out_tokens, kept, fid.kl, fid.agreement))
    return rows


def prefill(model, ids, capture_window: int = 64, reserve: int = 0):
    """The engine's prefill (a module-level name so tests can prove a resumed run never calls it)."""
    from ripplekv.prefill import prefill as engine_prefill

    return engine_prefill(model, ids, capture_window=capture_window, reserve=reserve)


# --------------------------------------------------------------------------- the run


def load_all_samples(plan: Plan, tokenizer) -> list[tuple[object, str, dict]]:
    """(task, sample id, record) in run order: tasks in order, samples in file order."""
    from ripplekv.data import load_samples

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
    from ripplekv.models import load_config

    layers = load_config(plan.settings.model).num_hidden_layers
    for method in plan.methods.values():
        if not method.allocator.needs_prompt:
            method.layer_budgets(layers, plan.settings.budgets[0], plan.settings.budgets[0] + 1)


def sample_rows(settings: EvalSettings, methods: dict, loaded: tuple, item: tuple) -> list[dict]:
    """One unit of work: a sample with all its (method, budget) variants, on `loaded` = (model, tokenizer)."""
    model, tokenizer = loaded
    task, sid, record = item
    return evaluate_sample(model, tokenizer, task, record, methods, settings.budgets, sid=sid,
                           max_length=settings.max_length, batch_size=settings.batch_size,
                           capture_window=settings.capture_window)


def run_samples(plan: Plan, todo: list, tokenizer, workers, console):
    """Yield `(item, rows)` for every sample of `todo`: in this process, or on Ray workers in finishing order."""
    from functools import partial

    from ripplekv import distributed
    from ripplekv.models import load_model

    s = plan.settings
    work = partial(sample_rows, s, plan.methods)
    if workers is None or not workers.uses_ray:
        model, _, _ = load_model(s.model, device=s.device, dtype=s.dtype)
        for item in todo:
            yield item, work((model, tokenizer), item)
        return
    device, dtype = plan.config["device"], plan.config["dtype"]
    setup = partial(distributed.load_model_on_worker, s.model, device, dtype)

    def retry(item, reason):
        console.print(f"[yellow]a worker died on {item[0].name}/{item[1]} ({reason}); running it again[/yellow]")

    yield from distributed.run_units(todo, setup, work, workers, device=device, on_retry=retry,
                                     label=lambda item: f"sample {item[0].name}/{item[1]}")


def run_eval(settings: EvalSettings, out: str | Path, console=None, workers=None) -> dict:
    """Run (or resume) an evaluation into `out`, then render its report; returns the report's tables.

    `workers` (a `distributed.Workers`) spreads the samples over Ray workers; this process still writes alone.
    """
    from rich.console import Console

    from ripplekv.models import load_tokenizer

    console = console or Console(stderr=True)
    out = Path(out)
    plan = plan_eval(settings)
    check_run_dir(out, plan.config)
    check_model_fits(plan)
    tokenizer = load_tokenizer(settings.model)
    work = load_all_samples(plan, tokenizer)
    config = {**plan.config, "samples": {}}
    for task, sid, _ in work:
        config["samples"].setdefault(task.name, []).append(sid)
    old = check_run_dir(out, config)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_run(out):
        return _run_locked(settings, out, plan, config, old, work, tokenizer, console, workers)


def _run_locked(settings, out: Path, plan: Plan, config: dict, old, work, tokenizer, console, workers=None) -> dict:
    """The part of `run_eval` that writes: only one process at a time per run directory."""
    from rich.markup import escape
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from ripplekv import report
    from ripplekv.progress import Throughput

    if old is None:
        write_json_atomic(out / CONFIG, config)
    done = finished_samples(out, config)
    todo = [item for item in work if (item[0].name, item[1]) not in done]

    if todo:
        console.print(f"[bold]eval[/bold] {len(work)} samples ({len(done)} already done), "
                      f"{len(variant_keys(config))} variants each -> {out}")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Throughput(),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        finished = len(done)
        try:
            with Progress(*columns, console=console, transient=False) as progress, \
                    (out / PREDICTIONS).open("a", encoding="utf-8") as fh, \
                    closing(run_samples(plan, todo, tokenizer, workers, console)) as results:
                bar = progress.add_task("samples", total=len(work), completed=len(done), resumed=len(done))
                for (task, sid, _), rows in results:  # in finishing order when workers run them
                    append_rows(fh, rows)
                    finished += 1
                    progress.update(bar, advance=1, description=f"{task.name} [dim]{escape(sid)}[/dim]")
        except KeyboardInterrupt:
            console.print(f"interrupted after {finished} of {len(work)} samples; "
                          "rerun the same command to resume")
            raise
    else:
        console.print(f"all {len(work)} samples already done in {out}; re-rendering the report")
    return report.render(out)
