"""How well each signal predicts DepthKV's measured drop: Spearman rho across layers with a bootstrap interval.

    python scripts/signal_vs_drop.py DROP_PROFILE SIGNAL_PROFILE... --out predictors.csv

DROP_PROFILE is a `ripplekv profile --signal evict` folder (the task-drop measure); each SIGNAL_PROFILE
another profile folder of the same model (`--signal noise`, `--signal evict --measure kl`, `--signal
infonce`). A profile may join several folders with commas (its disjoint calibration draws, pooled: `make
reproduce` pools its draws so the correlations rest on every draw's prompts). Writes one row per signal
(`analysis.predictors`) and prints one line each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ripplekv.analysis.predictors import predictor_table
from ripplekv.errors import UserError
from ripplekv.runs.safeio import check_output, write_csv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drop")
    parser.add_argument("signals", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        check_output(args.out, kind="file", inputs=[Path(p) for p in (args.drop, *args.signals)])
        table = predictor_table(args.drop, args.signals)
        write_csv(Path(args.out), table, float_format="%.6g")  # a missing folder is made; a failure is one line
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    for row in table.itertuples():
        print(f"{row.signal}: Spearman rho with the task drop {row.spearman:.3f} "
              f"[{row.low:.3f}, {row.high:.3f}] ({row.samples_drop} samples{', paired' if row.paired else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
