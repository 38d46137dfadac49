"""Calibration prompts: samples of the offline suite's calibration split, cut into a context and probe tokens.

`profile`, `allocate`, `route`, `tune` and `fit` calibrate on them (`Calibration` says which); the split is
disjoint from the evaluation samples.
A calibrated method is judged on more than one calibration draw (`Draw`): the split's samples are dealt into
`count` disjoint draws by their index (sample i of every task goes to draw i mod count), so two draws never
share a sample whatever each stage's prompt count, and the stages of one draw take prefixes of the same sequence
(they share prompts, as they did before draws existed). One draw (the default) is the whole split, as before.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ripplekv.errors import UserError


@dataclass
class CalibrationPrompt:
    """One calibration sample: its id, the context to compress, and the probe tokens after it; from the offline
    suite also its task's name and gold answers, so a measure can score the model's answer (DepthKV's task drop)."""

    sample_id: str
    context: list[int]
    probe: list[int]
    task: str | None = None
    answers: list[str] = field(default_factory=list)
    all_classes: list[str] | None = None


def split_prompt(sample_id: str, prompt_ids: list[int], probe_tokens: int, answer_ids=None) -> CalibrationPrompt:
    """Context = all but the last `probe_tokens` prompt tokens; probe = those tokens (+ the answer)."""
    if len(prompt_ids) <= probe_tokens + 1:
        raise UserError(f"calibration sample {sample_id} has {len(prompt_ids)} tokens, too short for {probe_tokens} probe tokens")
    return CalibrationPrompt(sample_id, list(prompt_ids[:-probe_tokens]), list(prompt_ids[-probe_tokens:]) + list(answer_ids or []))


MAX_DRAWS = 100


@dataclass(frozen=True)
class Draw:
    """Which disjoint share of the calibration split a stage calibrates on: draw `index` of `count`."""

    index: int = 0
    count: int = 1

    def check(self) -> Draw:
        if not (isinstance(self.count, int) and 1 <= self.count <= MAX_DRAWS):
            raise UserError(f"--calib-draws must be an integer from 1 to {MAX_DRAWS} (disjoint calibration draws), "
                            f"got {self.count}")
        if not (isinstance(self.index, int) and 0 <= self.index < self.count):
            raise UserError(f"--calib-draw must be an integer from 0 to {self.count - 1} (one of the --calib-draws "
                            f"{self.count} draws, counted from 0), got {self.index}")
        return self

    def owns(self, sample_index: int) -> bool:
        """Whether a task's calibration sample number `sample_index` belongs to this draw."""
        return sample_index % self.count == self.index

    def sample_index(self, position: int) -> int:
        """The task's sample index of this draw's `position`-th sample."""
        return self.index + position * self.count

    def record(self) -> dict:
        """What outputs record about the draw: nothing for the whole split (so earlier outputs still match)."""
        return {} if self.count == 1 else {"calib_draw": self.index, "calib_draws": self.count}

    def describe(self) -> str:
        return "the whole calibration split" if self.count == 1 else f"calibration draw {self.index} of {self.count}"


@dataclass(frozen=True)
class Calibration:
    """The calibration prompts a stage fits on: how many (`--calib-samples`), from which draw (`--calib-draw` of
    `--calib-draws`), built to what length (`--target-tokens`), with the reference answer as probes or not
    (`--with-answer`), from which tasks (`--calib-tasks`: every offline task by default; `calibration_tasks`).
    Every stage fitted on calibration prompts takes this one object, checked once."""

    samples: int = 8
    target_tokens: int = 3500
    draw: Draw = Draw()
    with_answer: bool = False
    tasks: tuple[str, ...] = ()

    def check(self) -> Calibration:
        if not isinstance(self.samples, int) or self.samples < 1:
            raise UserError(f"--calib-samples must be at least 1, got {self.samples}")
        from ripplekv.tasks.offline import MAX_TARGET_TOKENS, MIN_TARGET_TOKENS

        if not (isinstance(self.target_tokens, int) and MIN_TARGET_TOKENS <= self.target_tokens <= MAX_TARGET_TOKENS):
            raise UserError(f"--target-tokens must be {MIN_TARGET_TOKENS} to {MAX_TARGET_TOKENS}, got {self.target_tokens}")
        self.draw.check()
        calibration_tasks(list(self.tasks))  # an unknown task or a suite without a calibration split: one line now
        return self

    def record(self) -> dict:
        """What outputs record about the prompts' origin: the draw, and the tasks when not the default (so
        earlier outputs still match)."""
        return {**self.draw.record(), **({"calib_tasks": list(self.tasks)} if self.tasks else {})}

    def prompts(self, tokenizer, probe_tokens: int = 1, target_tokens: int | None = None,
                count: int | None = None) -> list[CalibrationPrompt]:
        """The prompts (`count` of them when given, e.g. with held-out ones after; else `samples`), built to
        `target_tokens` when given (a trial length), else to the stage's."""
        return calibration_prompts(tokenizer, self.samples if count is None else count, probe_tokens,
                                   self.target_tokens if target_tokens is None else target_tokens,
                                   with_answer=self.with_answer, tasks=list(self.tasks) or None, draw=self.draw)


def calibration_hash(prompts: list[CalibrationPrompt]) -> str:
    """A short fingerprint of the exact calibration tokens, so a profile can be matched to its data."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(p.sample_id.encode())
        digest.update(np.asarray(p.context + p.probe, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def calibration_prompts(
    tokenizer,
    count: int,
    probe_tokens: int,
    target_tokens: int = 3500,
    max_length: int = 7500,
    with_answer: bool = False,
    tasks: list[str] | None = None,
    seed: int = 0,
    draw: Draw = Draw(),
) -> list[CalibrationPrompt]:
    """`count` prompts from the calibration split of `tasks` (default: every offline task; `calibration_tasks`),
    from `draw`'s share of it, round-robin over the tasks.

    The calibration split is disjoint from the evaluation samples, so profiling never sees them; two draws of
    one split share no sample.
    """
    from ripplekv.tasks import build_prompt_ids, load_samples

    if count < 1:
        raise UserError(f"--calib-samples must be at least 1, got {count}")
    draw.check()
    chosen = calibration_tasks(tasks)
    per_task = -(-count // len(chosen))
    built = draw.sample_index(per_task - 1) + 1  # samples build in order: a task's first `built` hold the draw's
    pools = [
        (task, [record for i, record in enumerate(load_samples(task, tokenizer, split="calibration", limit=built,
                                                               target_tokens=target_tokens, seed=seed))
                if draw.owns(i)])
        for task in chosen
    ]
    if not any(records for _, records in pools):
        raise UserError("the calibration split is empty; build the offline suite or pass more --calib-samples")
    prompts: list[CalibrationPrompt] = []
    for index in range(per_task):
        for task, records in pools:
            if index < len(records) and len(prompts) < count:
                record = records[index]
                ids = build_prompt_ids(task, record, tokenizer, max_length)
                answer = tokenizer(record["answers"][0], add_special_tokens=False).input_ids if with_answer else None
                prompt = split_prompt(record["_id"], ids, probe_tokens, answer)
                prompt.task, prompt.answers = task.name, list(record["answers"])
                prompt.all_classes = list(record["all_classes"]) if record.get("all_classes") else None
                prompts.append(prompt)
    return prompts


def calibration_tasks(names: list[str] | None) -> list:
    """The tasks calibration reads: offline tasks by name, `SUITE:TASK` for another generated suite (RULER's
    tasks have a calibration split too: a study calibrates on the tasks it evaluates, never their eval samples)."""
    from ripplekv.defaults import GENERATED_SUITES
    from ripplekv.tasks import get_tasks

    if not names:
        return get_tasks("offline", None)
    chosen = []
    for name in names:
        suite, _, task = name.rpartition(":")
        suite = suite or "offline"
        if suite not in GENERATED_SUITES:
            raise UserError(f"calibration task {name!r}: only the generated suites ({', '.join(GENERATED_SUITES)}) "
                            "have a calibration split")
        chosen += [t for t in get_tasks(suite, [task]) if t not in chosen]
    return chosen
