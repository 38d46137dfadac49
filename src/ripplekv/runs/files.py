"""The files of an eval run directory that both `eval` (which writes them) and `report` (which reads them) know.

Kept apart from `evaluate` so that data flows one way: evaluate -> report -> runfiles.
"""

from __future__ import annotations

import json
from pathlib import Path

from ripplekv.errors import UserError

PREDICTIONS = "predictions.jsonl"
CONFIG = "config.json"
REFERENCE = "full"
# Bounds, not methods (the answer-aware oracle): reports mark them and leave them out of ranks.
CEILINGS = ("oracle",)


def is_ceiling(label) -> bool:
    """Whether a method label (`oracle`, `oracle:window=32`) names a ceiling."""
    return str(label).split(":", 1)[0].strip() in CEILINGS


def read_lines(path: Path) -> tuple[list[dict], bool]:
    """Parsed lines of a predictions file and whether a trailing partial line (a kill mid-write) was seen."""
    if not path.is_file():
        return [], False
    data = path.read_bytes()
    partial = bool(data) and not data.endswith(b"\n")
    lines = data.split(b"\n")
    if partial:
        lines = lines[:-1]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8 text
            raise UserError(f"{path} line {number} is not valid JSON; use a new --out directory") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number} is not a JSON object; use a new --out directory")
        rows.append(row)
    return rows, partial
