"""CompressKV's offline layer profile from the offline suite's calibration split (never the evaluated samples).

Each calibration prompt is prefilled once; a layer's error is the relative Frobenius error of its window
queries' attention output (after W_o) when its cache keeps only SnapKV's selection at `--budget`
(`ripplekv.methods.compresskv.layer_errors`), averaged over the prompts. The CSV it writes is what
`compresskv:profile=FILE` reads. Its cost is one prefill per calibration prompt, once per model. Every
option is checked before the model loads; a mistake is one `error:` line and exit code 2, nothing written.

    .venv/bin/python scripts/compresskv_profile.py --out runs/compresskv.csv [--calib-samples 6] [--budget 128] [--model M]
        [--calib-draw I --calib-draws N]   # one of N disjoint draws of the calibration split
"""

from __future__ import annotations

import argparse
import sys
import time

from ripplekv.errors import UserError


def check(args):
    """Every option, before any model work (the output's folder is made when missing, as the commands do);
    returns the calibration draw."""
    from ripplekv.engine.models import resolve_model
    from ripplekv.methods.core.budgets import check_budget
    from ripplekv.runs.safeio import check_output
    from ripplekv.tasks.calibration import Draw
    from ripplekv.tasks.offline import MAX_TARGET_TOKENS, MIN_TARGET_TOKENS

    for name in ("calib_samples", "window"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not MIN_TARGET_TOKENS <= args.target_tokens <= MAX_TARGET_TOKENS:
        raise UserError(f"--target-tokens must be {MIN_TARGET_TOKENS} to {MAX_TARGET_TOKENS}, got {args.target_tokens}")
    check_budget(args.budget)
    draw = Draw(args.calib_draw, args.calib_draws).check()
    source = resolve_model(args.model)
    check_output(args.out, kind="file", inputs=[source.location] if source.kind == "gguf" else [])
    return draw


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the layer,error CSV to write")
    parser.add_argument("--model", default=None, help="model id or folder (default: the bundled model)")
    parser.add_argument("--calib-samples", type=int, default=6)
    parser.add_argument("--budget", type=int, default=128, help="the small selection the error is measured at")
    parser.add_argument("--window", type=int, default=32, help="window queries standing in for decoding steps")
    parser.add_argument("--target-tokens", type=int, default=3500)
    parser.add_argument("--calib-draw", type=int, default=0, help="which of the --calib-draws disjoint draws (from 0)")
    parser.add_argument("--calib-draws", type=int, default=1, help="disjoint draws of the calibration split")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    try:
        draw = check(args)
        from ripplekv.engine.models import load_model
        from ripplekv.methods.compresskv import calibrate, write_profile
        from ripplekv.tasks.calibration import calibration_prompts

        model, tokenizer, _ = load_model(args.model, device=args.device, dtype=args.dtype)
        prompts = calibration_prompts(tokenizer, args.calib_samples, probe_tokens=1, target_tokens=args.target_tokens,
                                      draw=draw)
        start = time.perf_counter()
        errors = calibrate(model, [p.context + p.probe for p in prompts], args.budget, args.window)
        path = write_profile(args.out, errors)
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    print(f"wrote {path}: {len(errors)} layers from {len(prompts)} calibration prompts in "
          f"{time.perf_counter() - start:.1f} s; errors {min(errors):.4f} to {max(errors):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
