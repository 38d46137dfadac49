"""Compare two eval runs line by line: the same predictions, kept sets and fidelity, for every method.

    python scripts/compare_predictions.py RUN_A RUN_B [--kl 1e-5]

Lines are matched by (task, id, method, budget). Every field must be equal except `peak_memory_bytes`
(measured, not computed) and `kl`/`agreement`, which may differ by `--kl` (float rounding). Prints one
line per difference and a summary; exit code 1 when any line differs. A field that every line of one run lacks
(one written since the older run was made, e.g. `kv_bytes`) is named in the summary, not compared. Used to show
that a refactor changed no prediction (`docs/performance.md` lists the commands).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

IGNORED = {"peak_memory_bytes"}
CLOSE = {"kl", "agreement"}


def lines(run: Path) -> dict:
    """The run's result lines by (task, id, method, budget); anything else is one line saying what is wrong."""
    path = run / "predictions.jsonl"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise SystemExit(f"compare_predictions: no {path}: give the --out folders of two evals") from None
    found = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            found[(row["task"], row["id"], row["method"], row["budget"])] = row
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"compare_predictions: line {number} of {path} is not an eval's result line") from None
    return found


def one_sided_fields(a: dict, b: dict) -> set[str]:
    """Fields that every line of one run lacks and the other run has (added to the line since)."""
    fields = [set().union(*(row.keys() for row in run.values())) for run in (a, b)]
    return fields[0] ^ fields[1]


def differences(a: dict, b: dict, tolerance: float, skipped: set[str] = frozenset()) -> list[str]:
    found = [f"only in the first run: {key}" for key in sorted(set(a) - set(b), key=str)]
    found += [f"only in the second run: {key}" for key in sorted(set(b) - set(a), key=str)]
    for key in sorted(set(a) & set(b), key=str):
        left, right = a[key], b[key]
        for field in sorted((set(left) | set(right)) - IGNORED - skipped):
            x, y = left.get(field), right.get(field)
            if field in CLOSE and isinstance(x, float) and isinstance(y, float):
                if abs(x - y) > tolerance:
                    found.append(f"{key}: {field} {x!r} != {y!r}")
            elif x != y:
                found.append(f"{key}: {field} {str(x)[:80]!r} != {str(y)[:80]!r}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--kl", type=float, default=1e-5, help="largest KL/agreement difference taken as equal")
    args = parser.parse_args()
    a, b = lines(args.first), lines(args.second)
    skipped = one_sided_fields(a, b)
    found = differences(a, b, args.kl, skipped)
    for line in found:
        print(line)
    methods = sorted({key[2] for key in a})
    extra = f" (fields only one run has, not compared: {', '.join(sorted(skipped))})" if skipped else ""
    print(f"{len(a)} lines, {len(methods)} methods: {len(found)} differences{extra}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
