"""One strict reader for the per-layer tables users hand to methods: allocation CSVs (`layer,multiplier`)
and route CSVs (`layer,method`).

A table must be UTF-8 text with integer layer ids listing 0..L-1 once each; every problem is one
line naming the file and the line (as an editor counts, the header being line 1). A fractional or
infinite layer id is refused, never rounded, so a table is read exactly as it was written.
"""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path

from ripplekv.errors import UserError

_LAYER = re.compile(r"\s*\d+\s*")


def read_layer_table(path: str | Path, column: str, kind: str, remedy: str) -> list[tuple[int, str]]:
    """(line number, `column`'s text) ordered by layer, from a CSV whose `layer` column lists 0..L-1."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{kind} file {path} does not exist; {remedy}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise UserError(f"{kind} file {path} is not a readable CSV: not UTF-8 text (a binary file?); "
                        f"expected layer,{column} rows")
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as err:
        raise UserError(f"{kind} file {path} is not a readable CSV ({err})") from None
    numbered = [(number, row) for number, row in enumerate(rows, 1) if any(cell.strip() for cell in row)]
    if not numbered:
        raise UserError(f"{kind} file {path} is not a readable CSV (it is empty); expected a header "
                        f"layer,{column} and one row per layer")
    header = [cell.strip() for cell in numbered[0][1]]
    missing = [name for name in ("layer", column) if name not in header]
    if missing:
        raise UserError(f"{kind} file {path} lacks column(s) {', '.join(missing)}; expected layer,{column}")
    at_layer, at_value = header.index("layer"), header.index(column)
    if not numbered[1:]:
        raise UserError(f"{kind} file {path} has a header but no rows; expected one row per layer")
    seen: dict[int, tuple[int, str]] = {}
    for number, row in numbered[1:]:
        if len(row) != len(header):
            raise UserError(f"{kind} file {path} line {number} has {len(row)} fields, the header {len(header)}")
        layer = row[at_layer]
        if not _LAYER.fullmatch(layer):
            raise UserError(f"{kind} file {path} line {number}: layer {layer.strip()!r} is not a layer id "
                            "(a whole number 0, 1, ...)")
        layer = int(layer)
        if layer in seen:
            raise UserError(f"{kind} file {path} line {number}: layer {layer} is listed twice (also line "
                            f"{seen[layer][0]}); each layer must appear exactly once")
        seen[layer] = (number, row[at_value].strip())
    absent = [layer for layer in range(len(seen)) if layer not in seen]
    if absent:
        raise UserError(f"{kind} file {path} must list layers 0..{len(seen) - 1} once each; layer {absent[0]} is missing")
    return [seen[layer] for layer in range(len(seen))]


def read_multipliers(path: str | Path, kind: str, remedy: str) -> list[float]:
    """Multipliers by layer: finite numbers, none negative, at least one positive (a layer at 0 keeps
    only its scorer's floor, as DepthKV's proportional map gives a layer with no sensitivity)."""
    values = []
    for number, text in read_layer_table(path, "multiplier", kind, remedy):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise UserError(f"{kind} file {path} line {number}: multiplier {text!r} is not a finite number >= 0 "
                            "(negative or non-numeric)")
        values.append(value)
    if not any(v > 0 for v in values):
        raise UserError(f"{kind} file {path} has no positive multiplier; all must be >= 0 and one > 0")
    return values


def check_layer_count(found: int, num_layers: int, what: str, remedy: str) -> None:
    """A table of one model's layers used with another model is refused, naming both counts."""
    if found != num_layers:
        raise UserError(f"{what} has {found} layers but the model has {num_layers}; {remedy}")


def read_numbers(path: str | Path, column: str, kind: str, remedy: str) -> list[float]:
    """A finite number per layer (a sensitivity profile's kl_mean, ...)."""
    values = []
    for number, text in read_layer_table(path, column, kind, remedy):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise UserError(f"{kind} file {path} line {number} has a missing or non-numeric {column} value ({text!r})")
        values.append(value)
    return values
