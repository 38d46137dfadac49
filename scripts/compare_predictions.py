"""Compare two eval runs line by line: the same predictions, kept sets and fidelity, for every method.

    python scripts/compare_predictions.py RUN_A RUN_B [--kl 1e-5]

Lines are matched by (task, id, method, budget). Every field must be equal except `peak_memory_bytes`
(measured, not computed) and `kl`/`agreement`, which may differ by `--kl` (float rounding). Prints one
line per difference and a summary; exit code 1 when any line differs. Used to show that a refactor
changed no prediction (`docs/performance.md` lists the commands).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

IGNORED = {"peak_memory_bytes"}
CLOSE = {"kl", "agreement"}


def lines(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines() if line.strip()]
    return {(r["task"], r["id"], r["method"], r["budget"]): r for r in rows}


def differences(a: dict, b: dict, tolerance: float) -> list[str]:
    found = [f"only in the first run: {key}" for key in sorted(set(a) - set(b), key=str)]
    found += [f"only in the second run: {key}" for key in sorted(set(b) - set(a), key=str)]
    for key in sorted(set(a) & set(b), key=str):
        left, right = a[key], b[key]
        for field in sorted((set(left) | set(right)) - IGNORED):
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
    found = differences(a, b, args.kl)
    for line in found:
        print(line)
    methods = sorted({key[2] for key in a})
    print(f"{len(a)} lines, {len(methods)} methods: {len(found)} differences")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
