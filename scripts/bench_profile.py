"""Batched RippleKV profile vs the naive one (a fresh prefill per perturbed layer), side by side.

Both run on the same calibration samples, seeds and settings in this one process; the profiles must
agree (max |KL difference| is printed). The last line is `speedup X.XX`.

    .venv/bin/python scripts/bench_profile.py [--samples 2] [--target-tokens 2000] [--model M]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from naive_profile import profile_prompt_one_layer_at_a_time  # this folder's reference (scripts/naive_profile.py)

from ripplekv.defaults import PROBE_TOKENS, PROFILE_SEEDS
from ripplekv.engine.models import load_model
from ripplekv.pipeline.profile import ProfileSettings, profile_prompt
from ripplekv.tasks.calibration import calibration_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--target-tokens", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=PROFILE_SEEDS)
    parser.add_argument("--signal", default="noise", choices=("noise", "evict"))  # the KL signals it times
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    model, tokenizer, source = load_model(args.model, device=args.device, dtype=args.dtype)
    settings = ProfileSettings(seeds=args.seeds, signal=args.signal, probe_tokens=PROBE_TOKENS, measure="kl")
    prompts = calibration_prompts(tokenizer, args.samples, settings.probe_tokens, args.target_tokens)
    profile_prompt(model, prompts[0], settings, 0)  # warm-up: first-call overheads out of both timings
    batched_time = naive_time = 0.0
    worst = 0.0
    for index, prompt in enumerate(prompts):
        start = time.perf_counter()
        batched = profile_prompt(model, prompt, settings, index)
        batched_time += time.perf_counter() - start
        start = time.perf_counter()
        naive = profile_prompt_one_layer_at_a_time(model, prompt, settings, index)
        naive_time += time.perf_counter() - start
        worst = max(worst, float(np.abs(batched - naive).max() / max(naive.max(), 1e-12)))
        print(f"{prompt.sample_id}: {len(prompt.context) + len(prompt.probe)} tokens, batched {batched_time:.1f}s, naive {naive_time:.1f}s (cumulative)")
    print(f"model {source.label}, {len(prompts)} samples x {settings.seeds} seed(s), signal {settings.signal}")
    print(f"batched {batched_time:.1f}s  naive {naive_time:.1f}s  max relative KL difference {worst:.2e}")
    print(f"speedup {naive_time / batched_time:.2f}")


if __name__ == "__main__":
    main()
