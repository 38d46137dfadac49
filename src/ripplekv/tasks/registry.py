"""The task registry: every task of every suite, with its prompt, metric, generation settings and builder.

This is the one task -> metric table: scoring reads `task.metric` (a prediction file's dataset name is
resolved to its task by `task_named`).

Three suites: the bundled `offline` suite (built from real texts shipped with the install, no
download), `longbench` (the 21 LongBench v1 datasets) and `longbench-e` (the 13 LongBench-E sets,
named `<dataset>_e`). LongBench tasks take the official prompt, generation length and chat rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from ripplekv.defaults import SUITES
from ripplekv.errors import UserError
from ripplekv.tasks import prompts


@dataclass(frozen=True)
class Task:
    """One evaluation task; `name` is unique within its suite."""

    name: str
    suite: str
    category: str
    metric: str
    max_new_tokens: int
    prompt_template: str
    chat_template: bool
    stop_at_newline: bool  # generation stops at a newline (LongBench's samsum)
    first_line: bool = False  # scoring keeps the prediction's first line (the official scorer's few-shot rule)
    # offline tasks: builds `n` samples from an `offline_fit._Builder`; LongBench tasks are read from files
    builder: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def dataset(self) -> str:
        """The LongBench dataset behind a task (`hotpotqa_e` -> `hotpotqa`); offline tasks: the name."""
        return self.name[:-2] if self.suite == "longbench-e" else self.name


# dataset: (category, metric) as LongBench's eval.py scores it.
LONGBENCH_DATASETS = {
    "narrativeqa": ("Single-Doc QA", "qa_f1"),
    "qasper": ("Single-Doc QA", "qa_f1"),
    "multifieldqa_en": ("Single-Doc QA", "qa_f1"),
    "multifieldqa_zh": ("Single-Doc QA", "qa_f1_zh"),
    "hotpotqa": ("Multi-Doc QA", "qa_f1"),
    "2wikimqa": ("Multi-Doc QA", "qa_f1"),
    "musique": ("Multi-Doc QA", "qa_f1"),
    "dureader": ("Multi-Doc QA", "rouge_zh"),
    "gov_report": ("Summarization", "rouge"),
    "qmsum": ("Summarization", "rouge"),
    "multi_news": ("Summarization", "rouge"),
    "vcsum": ("Summarization", "rouge_zh"),
    "trec": ("Few-shot Learning", "classification"),
    "triviaqa": ("Few-shot Learning", "qa_f1"),
    "samsum": ("Few-shot Learning", "rouge"),
    "lsht": ("Few-shot Learning", "classification"),
    "passage_count": ("Synthetic", "count"),
    "passage_retrieval_en": ("Synthetic", "retrieval"),
    "passage_retrieval_zh": ("Synthetic", "retrieval_zh"),
    "lcc": ("Code", "code_sim"),
    "repobench-p": ("Code", "code_sim"),
}
# The official scorer keeps only the first line of the prediction for these (few-shot datasets whose
# models tend to keep generating further examples).
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")
LONGBENCH_E_DATASETS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)

# name: (category, metric, max_new_tokens, builder in `tasks.offline`). niah tasks count as "Synthetic",
# where LongBench puts its own synthetic retrieval tasks. Generation lengths: LongBench's for the
# borrowed formats; 32 for answers of a few tokens.
OFFLINE_TASKS = {
    "hotpotqa": ("Multi-Doc QA", "qa_f1", 32, "hotpotqa"),
    "squad": ("Single-Doc QA", "qa_f1", 32, "squad"),
    "passage_retrieval": ("Synthetic", "retrieval", 32, "passage_retrieval"),
    "passage_count": ("Synthetic", "count", 32, "passage_count"),
    "niah": ("Synthetic", "string_match", 32, "niah"),
    "niah_multikey": ("Synthetic", "string_match", 32, "niah_multikey"),
    "code_completion": ("Code", "code_sim", 64, "code_completion"),
}

# Offline tasks named only on request (`--tasks paragraph_recall`): not in the suite's default list, so the
# default offline runs (and `make reproduce-quick`) stay as they were. Long answers for decode budgets.
OFFLINE_OPT_IN_TASKS = {
    "paragraph_recall": ("Long Answer", "rouge", 256, "paragraph_recall"),
}


def _longbench_task(dataset: str, suite: str) -> Task:
    category, metric = LONGBENCH_DATASETS[dataset]
    return Task(
        name=dataset + ("_e" if suite == "longbench-e" else ""),
        suite=suite,
        category=category,
        metric=metric,
        max_new_tokens=prompts.official_max_new_tokens()[dataset],
        prompt_template=prompts.official_prompts()[dataset],
        chat_template=dataset not in prompts.NO_CHAT_DATASETS,
        stop_at_newline=dataset in prompts.STOP_AT_NEWLINE_DATASETS,
        first_line=dataset in FIRST_LINE_DATASETS,
    )


def _offline_task(name: str) -> Task:
    from ripplekv.tasks import offline  # the builders (a large module, imported when a task is made)

    category, metric, max_new, builder = {**OFFLINE_TASKS, **OFFLINE_OPT_IN_TASKS}[name]
    return Task(
        name=name,
        suite="offline",
        category=category,
        metric=metric,
        max_new_tokens=max_new,
        prompt_template=prompts.offline_prompt(name),
        chat_template=name != "code_completion",  # lcc-style, like LongBench's lcc
        stop_at_newline=False,
        builder=offline.BUILDERS[builder],
    )


def _suite_tasks(suite: str) -> list[Task]:
    if suite == "offline":
        return [_offline_task(name) for name in OFFLINE_TASKS]
    if suite == "longbench":
        return [_longbench_task(name, suite) for name in LONGBENCH_DATASETS]
    if suite == "longbench-e":
        return [_longbench_task(name, suite) for name in LONGBENCH_E_DATASETS]
    raise UserError(f"unknown suite {suite!r}; known suites: {', '.join(SUITES)}")


def all_tasks() -> list[Task]:
    """Every task of every suite, suites in `SUITES` order (the offline suite's opt-in tasks after its own)."""
    tasks = [task for suite in SUITES for task in _suite_tasks(suite)]
    return tasks + [_offline_task(name) for name in OFFLINE_OPT_IN_TASKS]


@cache
def task_named(name: str) -> Task:
    """The task a bare name means (a prediction file's `dataset`): a LongBench or LongBench-E dataset, or an
    offline task. Same-named tasks of two suites score alike (a test checks it), so the first one serves."""
    for task in all_tasks():
        if task.name == name:
            return task
    known = sorted({task.name for task in all_tasks()})
    raise UserError(f"unknown dataset {name!r}; known: {', '.join(known)}")


def list_suites() -> list[str]:
    """Names of the suites, the bundled offline one first."""
    return list(SUITES)


def get_tasks(suite: str, names: list[str] | None = None) -> list[Task]:
    """Tasks of `suite`, all of them or the named ones in the order given.

    In `longbench-e` the plain dataset name is accepted too (`hotpotqa` means `hotpotqa_e`).
    """
    tasks = _suite_tasks(suite)
    if not names:
        return tasks
    by_name = {task.name: task for task in tasks}
    if suite == "offline":
        by_name.update({name: _offline_task(name) for name in OFFLINE_OPT_IN_TASKS})
    if suite == "longbench-e":
        by_name.update({task.dataset: task for task in tasks})
    chosen: list[Task] = []
    for name in names:
        if name not in by_name:
            known = ", ".join([task.name for task in tasks] + (list(OFFLINE_OPT_IN_TASKS) if suite == "offline" else []))
            raise UserError(f"unknown task {name!r} in suite {suite}; known tasks: {known}")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    return chosen


def default_suite(data_dir: str | None = None) -> str:
    """`longbench` when the official files are on disk (data_dir, $RIPPLEKV_LONGBENCH_DIR or the
    default folder), else the bundled `offline` suite. Never touches the network."""
    from ripplekv.tasks import longbench

    return "longbench" if longbench.has_local_data(data_dir) else "offline"


def load_samples(
    task: Task,
    tokenizer,
    *,
    split: str = "eval",
    limit: int | None = None,
    data_dir: str | None = None,
    target_tokens: int = 3500,
    seed: int = 0,
) -> list[dict]:
    """Records of `task` in the LongBench schema (input, context, answers, length, dataset, language,
    all_classes, _id).

    Offline tasks are built on the fly from `tokenizer`, `target_tokens` and `seed`; `split` is
    "eval" or "calibration" (disjoint sources). LongBench tasks read the official test set in file
    order (`target_tokens` and `seed` do not apply; prompts are truncated later by
    `build_prompt_ids`) and have no calibration split (a subset of another dataset would still be
    LongBench test data someone evaluates on): profiling calibrates on the offline suite's
    calibration split instead.
    """
    if split not in ("eval", "calibration"):
        raise UserError(f"unknown split {split!r}; known splits: eval, calibration")
    if limit is not None and limit < 0:
        raise UserError(f"limit must be zero or more, got {limit}")
    if task.suite == "offline":
        from ripplekv.tasks import offline

        return offline.build_samples(task, tokenizer, split=split, limit=limit,
                                     target_tokens=target_tokens, seed=seed)
    if split == "calibration":
        raise UserError(
            f"LongBench ({task.name}) has no calibration split; calibrate on the offline suite "
            "(suite 'offline', split 'calibration') instead"
        )
    from ripplekv.tasks import longbench

    records = longbench.read_records(task.name, data_dir)
    return records if limit is None else records[:limit]


def task_rows(suite: str | None = None, data_dir: str | None = None) -> list[dict]:
    """One row per task for `ripplekv tasks`: size is the local record count when the official
    files are on disk ("200 local"), else LongBench's published test-set size ("200 official");
    offline: the default eval size and, in brackets, the calibration size."""
    from ripplekv.tasks import longbench, offline

    rows = []
    for name in [suite] if suite else list_suites():
        opt_in = [_offline_task(task) for task in OFFLINE_OPT_IN_TASKS] if name == "offline" else []
        for task in get_tasks(name) + opt_in:
            if task.suite == "offline":
                size = f"{offline.DEFAULT_SIZES['eval']} (+{offline.DEFAULT_SIZES['calibration']} cal)"
                size += " opt-in: --tasks" if task.name in OFFLINE_OPT_IN_TASKS else ""
            else:
                local = longbench.local_record_count(task.name, data_dir)
                size = f"{local} local" if local is not None else f"{longbench.OFFICIAL_SIZES[task.name]} official"
            rows.append({
                "suite": task.suite, "task": task.name, "category": task.category, "metric": task.metric,
                "max_new_tokens": task.max_new_tokens, "size": size,
            })
    return rows
