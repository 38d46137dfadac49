"""LU-KV's offline head-budget curves from the offline suite's calibration split (never the evaluated samples).

Each calibration prompt is prefilled once; the full cache's greedy answer (at most --answer-tokens) is read
back through the full cache for the oracle importance of every entry, each method's scorer ranks the
entries, and LU-KV's greedy over the convex-hull relaxation gives the prompt's per-head prune ratios at the
99 global ratios; their mean over prompts is the curve (`ripplekv.pipeline.head_curves`). One curve file
per scorer, `OUT/curve-SCORER.csv` with its provenance in `OUT/curve-SCORER.json`; `SPEC:curve=FILE` reads
it. Resumable: a rerun with the same settings computes only the prompts not yet in OUT/samples.jsonl.

    .venv/bin/python scripts/lukv_profile.py --out runs/lukv [--methods lukv,lukv:scorer=snapkv]
        [--calib-samples 8] [--target-tokens 3500] [--answer-tokens 64] [--per-layer] [--model M]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.pipeline.head_curves import CurveSettings, profile_curves


def progress_bar(total: int, done: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("calibration prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        transient=True)
    task = progress.add_task("profile", total=total, completed=done)
    return progress, lambda _index: progress.advance(task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder for the curves and the resumable log")
    parser.add_argument("--methods", default="lukv,lukv:scorer=snapkv", help="LU-KV method specs, one curve per scorer")
    parser.add_argument("--model", default=None, help="model id or folder (default: the bundled model)")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--target-tokens", type=int, default=3500)
    parser.add_argument("--answer-tokens", type=int, default=64, help="the full cache's answer read for the oracle")
    parser.add_argument("--per-layer", action="store_true", help="one greedy per layer (default: all layers at once)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    settings = CurveSettings(args.calib_samples, args.target_tokens, args.answer_tokens, not args.per_layer)
    start = time.perf_counter()
    try:
        written = profile_curves(Path(args.out), args.model, [s.strip() for s in args.methods.split(",") if s.strip()],
                                 settings, args.device, args.dtype, bar=progress_bar)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for name, path in written.items():
        print(f"wrote {path} ({name}) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
