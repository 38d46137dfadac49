"""What `ripplekv eval` was asked for, checked before any model work: the settings and the run's config.

`EvalSettings` is the user's input resolved (lists parsed by `parse_names` / `parse_budgets`, defaults
filled in); `plan_eval` validates it, builds the methods and tasks, and records in `Plan.config` what
defines the run's results (model and its fingerprint, prompt lengths, method specs, allocation and route
hashes, ...), the config.json that later runs are compared with. It raises a UserError before any
model is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ripplekv.defaults import (
    BLOCKWISE_PROTOCOL,
    DECODE_BUDGETS,
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_EVAL_METHODS,
    EVAL_BATCH_SIZE,
    GENERATED_SUITES,
    LAST_ALLOCATION,
    MULTI_QUESTION_PROTOCOLS,
    PROTOCOLS,
)
from ripplekv.engine.prefill import Requirements, captured_window
from ripplekv.engine.schedule import DEFAULT_COMPRESS_EVERY
from ripplekv.errors import UserError
from ripplekv.methods.core.budgets import check_budget
from ripplekv.runs.files import ANSWER_AWARE, REFERENCE
from ripplekv.runs.resume import variant_keys

DEFAULT_METHODS = DEFAULT_EVAL_METHODS
SPLITS = ("eval", "calibration")
SHIPPED_ALLOCATIONS = Path(__file__).resolve().parents[1] / "data" / "allocations"


@dataclass(frozen=True)
class EvalSettings:
    """What the user asked for, resolved (defaults filled in, lists parsed)."""

    budgets: tuple[int, ...]
    methods: tuple[str, ...] = DEFAULT_METHODS
    suite: str = "offline"
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    # "calibration": the generated suites' calibration split (a task screen reads it; evaluation never should)
    split: str = "eval"
    allocation: str | None = None
    model: str | None = None
    data_dir: str | None = None
    target_tokens: int = 3500
    max_length: int = 7500
    batch_size: int = EVAL_BATCH_SIZE
    seed: int = 0
    method_options: dict = field(default_factory=dict)
    route: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    protocol: str = "with-question"
    block_tokens: int | None = None  # --protocol blockwise: tokens per block (None: DEFAULT_BLOCK_TOKENS)
    decode_budget: str = "prompt"
    compress_every: int | None = None  # None: DEFAULT_COMPRESS_EVERY under a total budget
    # Bytes a sample may hold (None: `engine.memory.default_budget`); it never changes results, so config.json
    # does not record it and a resumed run may use another.
    memory_budget: int | None = None


def parse_names(text: str | Sequence[str] | None, setting: str | None = None) -> tuple[str, ...]:
    """`"a,b, c"` (or several such strings) -> ('a', 'b', 'c'), duplicates dropped, order kept.

    With `setting` (e.g. "methods", spelt `--methods` by the CLI), a given but empty list is a UserError rather
    than "none".
    """
    if text is None:
        return ()
    items = [text] if isinstance(text, str) else list(text)
    names = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
    if setting and not names:
        setting = setting.lstrip("-")
        raise UserError(f"{{{setting}}} is empty; name at least one, comma-separated (or leave the option out)", setting)
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
        raise UserError("{budgets} is empty; give at least one budget (average entries kept per layer per KV head), "
                        "e.g. 128", "budgets")
    return tuple(sorted(set(budgets)))


def default_allocation(specs: Sequence[str], bundled: bool) -> tuple[str | None, str | None]:
    """The allocation CSV for methods with file budgets (ripplekv, depthkv, routed-ripplekv) when none is given,
    and what to tell the user: the last `ripplekv allocate` output (`defaults.LAST_ALLOCATION`, under the
    working directory), else the one shipped for the bundled model (`bundled`: the model is the bundled one),
    else none (the method then says how to make one). (None, None) when no method of `specs` takes one. The one
    rule for `eval`, `budgets` and the Python API."""
    from ripplekv.engine.models import DEFAULT_MODEL
    from ripplekv.methods.core.spec import options_taken, parse_spec

    # a spec that names its own file takes no default (the notice would name a file nothing reads)
    unset = [spec for spec in specs if "allocation" not in parse_spec(spec)[1]]
    if "allocation" not in options_taken(unset):
        return None, None
    if LAST_ALLOCATION.is_file():
        return str(LAST_ALLOCATION), f"ripplekv: using the last allocation, {LAST_ALLOCATION}"
    if bundled:
        return str(SHIPPED_ALLOCATIONS / f"{DEFAULT_MODEL}.csv"), (
            f"ripplekv: no {LAST_ALLOCATION} yet; using the allocation shipped for {DEFAULT_MODEL} "
            "(made by `make reproduce`)")
    return None, None


@dataclass
class Plan:
    """Everything checked before any model work: settings, tasks, methods, the run's config."""

    settings: EvalSettings
    tasks: list  # list[Task]
    methods: dict  # name -> Method, `full` first
    config: dict
    notes: list = field(default_factory=list)  # `note:` lines for the user (names that were aliases)


RULER_CHAT_ROOM = 64  # tokens a chat template may add around RULER's task text


def plan_eval(settings: EvalSettings) -> Plan:
    """Validate the user's input and build the config; raises UserError before any model is loaded."""
    from ripplekv import __version__
    from ripplekv.engine.models import (
        check_model_files,
        file_sha256,
        model_fingerprint,
        resolve_device_dtype,
        resolve_model,
        runtime_info,
    )
    from ripplekv.methods.core.catalog import build_methods
    from ripplekv.methods.core.spec import reads_allocation
    from ripplekv.tasks import get_tasks
    from ripplekv.tasks.registry import multi_question_tasks

    for budget in settings.budgets:
        check_budget(budget)
    if not settings.budgets:
        raise UserError("give at least one --budget, e.g. --budget 128")
    if settings.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {settings.batch_size}")
    if settings.memory_budget is not None and (isinstance(settings.memory_budget, bool)
                                               or not isinstance(settings.memory_budget, int) or settings.memory_budget < 1):
        raise UserError(f"--memory-budget must be a positive number of bytes, got {settings.memory_budget!r}")
    if settings.protocol not in PROTOCOLS:
        raise UserError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {settings.protocol!r}")
    if not settings.methods:
        raise UserError("--methods is empty; name at least one method, e.g. --methods snapkv")
    if settings.split not in SPLITS:
        raise UserError(f"--split must be one of {', '.join(SPLITS)}, got {settings.split!r}")
    if settings.split != "eval" and settings.suite not in GENERATED_SUITES:
        raise UserError(f"--split {settings.split} needs a generated suite (offline or ruler): "
                        f"{settings.suite} has only its test set")
    if settings.limit is not None and settings.limit < 1:
        raise UserError(f"--limit must be at least 1, got {settings.limit}")
    if settings.target_tokens < 1:
        raise UserError(f"--target-tokens must be positive, got {settings.target_tokens}")
    if settings.max_length < 2:
        raise UserError(f"--max-length must be at least 2 tokens, got {settings.max_length}")
    if settings.suite == "ruler" and settings.target_tokens + RULER_CHAT_ROOM > settings.max_length:
        # RULER's prompts fill --target-tokens, plus the chat template: cut in the middle they would lose needles
        raise UserError(f"RULER prompts of --target-tokens {settings.target_tokens} need --max-length "
                        f"{settings.target_tokens + RULER_CHAT_ROOM} or more (got {settings.max_length})")
    # The full cache is always computed (it is the reference for fidelity), so it is always reported.
    shared = {**settings.method_options, "allocation": settings.allocation, "route": settings.route}
    notes: list[str] = []
    methods = build_methods(settings.methods, shared, notes)
    decoding = check_decode_budget(settings, methods.values())
    built = list(methods.values())
    names = tuple(methods)
    multi = settings.protocol in MULTI_QUESTION_PROTOCOLS
    tasks = (multi_question_tasks if multi else get_tasks)(settings.suite, list(settings.tasks) or None)
    if multi:
        check_multi_question(settings, methods)
    blockwise = check_block_tokens(settings, methods)
    source = resolve_model(settings.model)
    device, dtype = resolve_device_dtype(settings.device, settings.dtype)
    allocation = settings.allocation if any(reads_allocation(m.describe()) for m in built) else None
    route = settings.route if any("route" in m.describe().get("scorer", {}) for m in built) else None
    check_model_files(settings.model)
    config = {
        "command": "eval",
        "budgets": list(settings.budgets),
        "methods": list(names),
        "method_specs": {label: method.describe() for label, method in methods.items()},
        ANSWER_AWARE: [label for label, method in methods.items() if method.knows_answer],
        "suite": settings.suite,
        "tasks": [task.name for task in tasks],
        "limit": settings.limit,
        **({"split": settings.split} if settings.split != "eval" else {}),  # older runs (eval) have no key
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
        "allocation_sha256": None if allocation is None else file_sha256(allocation),
        "route": str(Path(route).resolve()) if route else None,
        "route_sha256": None if route is None else file_sha256(route),
        "device": device,
        "dtype": dtype,
        "protocol": settings.protocol,
        **blockwise,
        **decoding,
        **runtime_info(device),
        "ripplekv_version": __version__,
    }
    return Plan(settings=settings, tasks=tasks, methods=methods, config=config, notes=notes)


def check_decode_budget(settings: EvalSettings, methods) -> dict:
    """Refuse what a total decode budget cannot do, before any model work; returns what config.json records
    (nothing under `prompt`, so its runs stay byte-identical to those made before the option existed)."""
    if settings.decode_budget not in DECODE_BUDGETS:
        raise UserError(f"--decode-budget must be one of {', '.join(DECODE_BUDGETS)}, got {settings.decode_budget!r}")
    if settings.decode_budget == "prompt":
        if settings.compress_every is not None:
            raise UserError("--compress-every applies only with --decode-budget total (prompt budgets never evict while decoding)")
        return {}
    every = DEFAULT_COMPRESS_EVERY if settings.compress_every is None else settings.compress_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UserError(f"--compress-every must be a positive integer, got {every!r}")
    if settings.protocol != "with-question":
        raise UserError("--decode-budget total runs with --protocol with-question only (the question read through "
                        "a compressed cache is not evicted step by step yet)")
    for method in methods:
        if method.is_full:
            continue
        policy = getattr(method, "decode_policy", None)
        if policy is None or policy(every) is None:
            raise UserError(f"{method.label} cannot compress while decoding (no decoding-phase eviction): "
                            "drop it from --methods or use --decode-budget prompt")
    return {"decode_budget": "total", "compress_every": every}


def check_block_tokens(settings: EvalSettings, methods: dict) -> dict:
    """--block-tokens only with --protocol blockwise, which runs only the methods that can evict block by block
    (`methods.core.blockwise`); returns what config.json records (nothing under the other protocols)."""
    from ripplekv.methods.core.blockwise import check_blockwise

    if settings.protocol != BLOCKWISE_PROTOCOL:
        if settings.block_tokens is not None:
            raise UserError("--block-tokens applies only with --protocol blockwise")
        return {}
    block = DEFAULT_BLOCK_TOKENS if settings.block_tokens is None else settings.block_tokens
    check_blockwise({label: method for label, method in methods.items() if label != REFERENCE}, block)
    return {"block_tokens": block}


def check_multi_question(settings: EvalSettings, methods: dict) -> None:
    """What the multi-question protocols cannot run, refused before any model work: a method that reads the full
    cache's answer (several questions have several answers, and the context is compressed once)."""
    knowing = [label for label, method in methods.items() if method.knows_answer]
    if knowing:
        raise UserError(f"{', '.join(knowing)} read(s) the full cache's answer, but --protocol {settings.protocol} "
                        "compresses the context once for several answers: drop it from --methods")


def check_prompts_fit(plan: Plan, work, tokenizer, config) -> None:
    """Every prompt plus its answer within the model's positions (`config`: the model's), before any weights load
    or line is written: else one line naming the --max-length that makes every prompt fit (measured through the
    prompt template)."""
    from ripplekv.engine.adapter import check_length
    from ripplekv.tasks import build_prompt_ids

    limit = getattr(config, "max_position_embeddings", None) or 0
    fits, worst = None, None
    for task, _, record in work:
        prompt = len(build_prompt_ids(task, record, tokenizer, plan.settings.max_length))
        if worst is None or prompt + task.max_new_tokens > sum(worst):
            worst = (prompt, task.max_new_tokens)
        if limit and prompt + task.max_new_tokens > limit:
            length = fitting_max_length(task, record, tokenizer, min(plan.settings.max_length, prompt), limit)
            fits = length if fits is None else min(fits, length)
    if worst is not None:
        check_length(config, *worst, fits=fits)


def fitting_max_length(task, record, tokenizer, start: int, limit: int) -> int:
    """The --max-length (searched down from `start`) at which this prompt plus its answer fits `limit` tokens."""
    from ripplekv.tasks import build_prompt_ids

    length = start
    while length > 1:
        total = len(build_prompt_ids(task, record, tokenizer, length)) + task.max_new_tokens
        if total <= limit:
            return length
        length = max(1, length - (total - limit))
    return 1


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
    questions: int = 1  # asked of the one prefilled context (the multi-question protocols)

    @property
    def decode_units(self) -> int:
        # The full cache is decoded again even when its row exists: it is the fidelity reference.
        return (1 + len(self.variants)) * self.task.max_new_tokens * self.questions


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
            asked = len(record.get("questions") or ()) if plan.settings.protocol in MULTI_QUESTION_PROTOCOLS else 1
            jobs.append(Job(task, sid, record, missing, with_full, n, entry["prompt_tokens"], max(asked, 1)))
    return jobs
