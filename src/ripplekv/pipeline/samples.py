"""One prompt to look at: a sample of a suite's task exactly as `eval` builds it, or a text file.

`ripplekv inspect` and the Python API (`ripplekv.sample_prompt`) share this, so a prompt compressed from
Python is token for token the one `eval` scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError


@dataclass(frozen=True)
class Prompt:
    """Token ids of one prompt, where its question starts (the context-only boundary) and its gold answers."""

    ids: list[int]
    question_start: int
    answers: list[str]
    label: str
    task: object | None = None  # the Task a suite sample comes from (its max_new_tokens, stop rule)
    record: dict | None = None


def sample_prompt(tokenizer, task: str, index: int = 0, *, suite: str = "offline", data_dir: str | None = None,
                  target_tokens: int = 3500, max_length: int = 7500, seed: int = 0) -> Prompt:
    """Sample `index` of `task`, built as `eval` builds it with the same options."""
    from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples
    from ripplekv.tasks.prompts import question_start

    if index < 0:
        raise UserError(f"--index must be >= 0, got {index}")
    (chosen,) = get_tasks(suite, [task])
    records = load_samples(chosen, tokenizer, limit=index + 1, data_dir=data_dir, target_tokens=target_tokens,
                           seed=seed)
    if index >= len(records):
        raise UserError(f"task {chosen.name} has {len(records)} samples; --index must be below that")
    record = records[index]
    ids = build_prompt_ids(chosen, record, tokenizer, max_length)
    return Prompt(ids, question_start(chosen, record, tokenizer, max_length), list(record["answers"]),
                  f"{chosen.name} #{index}", chosen, record)


def file_prompt(tokenizer, path: str | Path) -> Prompt:
    """A text file read as the whole prompt (no question boundary, no answers)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    ids = list(tokenizer(path.read_text(encoding="utf-8", errors="replace")).input_ids)
    return Prompt(ids, len(ids), [], path.name)
