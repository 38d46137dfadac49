"""Each calibrated method's spread across calibration draws, beside its interval over samples (`make reproduce`).

    python scripts/calibration_spread.py OUT

Reads OUT/draws.csv (which eval label is which draw, written by calibration_draws.py), OUT/eval (draw 0) and
OUT/eval-draws (the further draws) and writes OUT/calibration_spread.csv (per method and budget: draw 0's KL and
interval, every draw's KL, their SD and range, each draw's KL difference to the uniform baseline) and
OUT/calibration_spread_per_draw.csv (one row per method, draw and budget). Prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from ripplekv.analysis.calibration_spread import spread, spread_markdown
from ripplekv.analysis.report import load_predictions
from ripplekv.errors import UserError
from ripplekv.runs.safeio import write_csv


def main(out: Path) -> int:
    try:
        table_path = out / "draws.csv"
        if not table_path.is_file():
            raise UserError(f"{table_path} is missing: run scripts/calibration_draws.py variants first")
        draws = pd.read_csv(table_path)
        first = load_predictions(out / "eval")
        further = load_predictions(out / "eval-draws")
        frame = pd.concat([first, further[~further["method"].isin(set(first["method"]))]], ignore_index=True)
        summary, per_draw = spread(frame, draws)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_csv(out / "calibration_spread.csv", summary, float_format="%.6g")
    write_csv(out / "calibration_spread_per_draw.csv", per_draw, float_format="%.6g")
    print(spread_markdown(summary) if not summary.empty else "no method ran on two or more draws")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: calibration_spread.py OUT")
    sys.exit(main(Path(sys.argv[1])))
