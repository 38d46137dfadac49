"""Resuming an eval run from its predictions.jsonl: which (sample, method, budget) lines exist, and appending more.

`variant_keys` says which (method, budget) lines a finished sample has; `existing_lines` reads what a
run directory already holds (cutting off the sample a kill left half-written) and `append_rows` writes
one sample's lines in one fsynced write, so a killed run loses at most the sample in flight.
"""

from __future__ import annotations

import json
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.runs.files import PREDICTIONS, REFERENCE, read_lines, sample_of
from ripplekv.runs.safeio import append_bytes, cut_to


def variant_keys(config: dict) -> set[tuple[str, int | None]]:
    """The (method, budget) pairs every finished sample has: full once, every other method at every budget."""
    keys = {(REFERENCE, None)}
    keys.update((m, b) for m in config["methods"] if m != REFERENCE for b in config["budgets"])
    return keys


def existing_lines(out: Path) -> dict[tuple[str, str], dict]:
    """Per (task, sample): the (method, budget) pairs already written and the prompt length they saw (a sample
    asked several questions writes a line per question and variant, all under its `context_id`: `files.sample_of`).

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
        last = (rows[-1]["task"], sample_of(rows[-1])) if rows else None
        while rows and (rows[-1]["task"], sample_of(rows[-1])) == last:
            rows.pop()
            keep = keep[: keep.rstrip(b"\n").rfind(b"\n") + 1]
        cut_to(path, len(keep))
    have: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = have.setdefault((row["task"], sample_of(row)), {"variants": set(), "prompt_tokens": row.get("prompt_tokens")})
        entry["variants"].add((row["method"], row["budget"]))
    return have


def append_rows(fh, rows: list[dict]) -> None:
    """One sample's lines in one write, flushed to disk before the next sample starts; a write that fails
    (a full disk) leaves the file as it was before the sample and raises one line (`safeio.append_bytes`)."""
    append_bytes(fh, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
