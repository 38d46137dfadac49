"""One reader for the JSON-lines files ripplekv appends to (predictions, unit logs).

Appending is not atomic: a kill mid-write leaves a torn last line (bytes without the final newline).
Every reader must treat it the same way: whole lines are results, the torn tail is not, and the caller
decides what to say or cut. Any other line that is not a JSON object is damage, named by line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ripplekv.errors import UserError


@dataclass
class Lines:
    """Whole lines as (1-based line number, object), the torn tail's bytes (b"" when none) and the
    file's size up to the end of the last whole line."""

    rows: list[tuple[int, dict]] = field(default_factory=list)
    torn: bytes = b""
    whole_size: int = 0

    @property
    def objects(self) -> list[dict]:
        return [row for _, row in self.rows]


def read_jsonl(path: str | Path, remedy: str = "use a new --out directory") -> Lines:
    """The lines of `path` (a missing file reads as empty); a whole line that is not a JSON object is a
    one-line UserError naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return Lines()
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    lines = Lines(torn=data[cut:], whole_size=cut)
    for number, raw in enumerate(data[:cut].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8 text
            raise UserError(f"{path} line {number} is not valid JSON; {remedy}") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number} is not a JSON object; {remedy}")
        lines.rows.append((number, row))
    return lines


def torn_fields(torn: bytes, names=("task", "id", "method", "budget")) -> dict:
    """What can still be read of a torn line's leading fields (json.dumps writes them in order), for
    telling the user which result was lost."""
    import re

    text = torn.decode("utf-8", errors="replace")
    found = {}
    for name in names:
        match = re.search(rf'"{name}":\s*("(?:[^"\\]|\\.)*"|-?\d+|null)', text)
        if match:
            try:
                found[name] = json.loads(match.group(1))
            except ValueError:
                pass
    return found
