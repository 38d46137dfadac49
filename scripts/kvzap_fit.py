"""KVzap's surrogates (MLP and linear) fitted on the offline suite's calibration split (never the evaluated samples).

Each calibration prompt is prefilled once, recording every layer's attention input; our KVzip scorer's
reconstruction pass scores the entries, and --tokens random positions per prompt become training pairs
(hidden state -> log KVzip score per KV head). One prompt in every --holdout is held out: the per-layer rank
correlation with KVzip's scores there is printed and stored in the provenance (`ripplekv.pipeline.kvzap_fit`).
Writes `OUT/kvzap-mlp.safetensors` and `OUT/kvzap-linear.safetensors` with their `.json`; a method reads one
as `kvzap:weights=FILE` (and `model=linear` for the linear one). Resumable: a rerun with the same settings
collects only the prompts not yet in OUT/samples.jsonl.

    .venv/bin/python scripts/kvzap_fit.py --out runs/kvzap [--models mlp,linear] [--calib-samples 16]
        [--target-tokens 1000] [--tokens 500] [--holdout 4] [--epochs 15] [--model M]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.pipeline.kvzap_fit import FitSettings, fit_surrogates


def progress_bar(total: int, done: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("calibration prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        transient=True)
    task = progress.add_task("kvzap", total=total, completed=done)
    return progress, lambda _index: progress.advance(task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder for the weights and the resumable pairs")
    parser.add_argument("--models", default="mlp,linear", help="surrogate kinds to fit (mlp, linear)")
    parser.add_argument("--model", default=None, help="model id or folder (default: the bundled model)")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--target-tokens", type=int, default=1000, help="prompt length (the paper keeps 750-1250)")
    parser.add_argument("--tokens", type=int, default=500, help="random positions per prompt (the paper's 500)")
    parser.add_argument("--holdout", type=int, default=4, help="every N-th prompt is held out to measure the fit")
    parser.add_argument("--epochs", type=int, default=15, help="the MLP's training epochs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    settings = FitSettings(args.calib_samples, args.target_tokens, args.tokens, args.holdout, args.epochs)
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    start = time.perf_counter()
    try:
        written = fit_surrogates(Path(args.out), args.model, settings, kinds, args.device, args.dtype, bar=progress_bar)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for kind, (path, fit) in written.items():
        print(f"wrote {path} ({kind}): held-out rank correlation with KVzip {fit['spearman_mean']:.3f} (per layer "
              f"{min(fit['spearman_per_layer']):.3f}-{max(fit['spearman_per_layer']):.3f}), R^2 {fit['r2_mean']:.3f}")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
