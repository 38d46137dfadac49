"""The --methods lists `make reproduce` derives from its calibration: tuned baselines and calibration draws.

    python scripts/calibration_draws.py tuned METHODS TUNE_JSON
        METHODS with each tuned baseline (`ripplekv tune`'s result) replaced by its tuned spec.
    python scripts/calibration_draws.py variants METHODS --root OUT --draws N [--allocation A] [--route R] --table CSV
        The further draws' variants of every calibrated method in METHODS (`pipeline.draws`), comma-joined, and
        the (method, draw, variant) table the results page reads.

Each prints one line (possibly empty) for the shell to use; a mistake is one line `error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ripplekv.errors import UserError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tuned = commands.add_parser("tuned")
    tuned.add_argument("methods")
    tuned.add_argument("tune_json")
    variants = commands.add_parser("variants")
    variants.add_argument("methods")
    variants.add_argument("--root", required=True, help="the run folder the draws' outputs are in")
    variants.add_argument("--draws", type=int, required=True)
    variants.add_argument("--allocation", default=None, help="the eval's --allocation")
    variants.add_argument("--route", default=None, help="the eval's --route")
    variants.add_argument("--table", required=True, help="the (method, draw, variant) CSV to write")
    args = parser.parse_args()
    try:
        if args.command == "tuned":
            from ripplekv.pipeline.tune import apply_tuned, read_tuned

            print(apply_tuned(args.methods, read_tuned(args.tune_json)))
        else:
            from ripplekv.pipeline.draws import draw_variants
            from ripplekv.runs.safeio import write_csv

            extra, table = draw_variants(args.methods, args.root, args.draws,
                                         {"allocation": args.allocation, "route": args.route})
            write_csv(Path(args.table), table)
            print(",".join(extra))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
