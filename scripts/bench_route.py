"""Batched routing preferences vs re-prefilling per (layer, method) trial, side by side.

Both compute the same [layers x methods] KL matrix on the same calibration samples in this one
process; they must agree (max relative difference is printed). The last line is `speedup X.XX`.

    .venv/bin/python scripts/bench_route.py [--samples 1] [--target-tokens 1500] [--methods a,b,...] [--model M]

The default candidates are `ripplekv route`'s defaults (snapkv, streamingllm, h2o, tova, knorm); every
trial costs the naive way one prefill whatever its scorer.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from naive_route import preferences_one_trial_at_a_time  # this folder's reference (scripts/naive_route.py)

from ripplekv.engine.models import load_model
from ripplekv.pipeline.route import RouteSettings, candidate_methods, preference_prompt
from ripplekv.tasks.calibration import calibration_prompts

METHODS = "snapkv,streamingllm,h2o,tova,knorm"  # the routing defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--target-tokens", type=int, default=1500)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    model, tokenizer, source = load_model(args.model, device=args.device, dtype=args.dtype)
    specs = tuple(args.methods.split(","))
    settings = RouteSettings(methods=specs, budget=args.budget, probe_tokens=16)
    candidates = candidate_methods(specs)
    prompts = calibration_prompts(tokenizer, args.samples, settings.probe_tokens, args.target_tokens)
    preference_prompt(model, prompts[0], candidates, settings)  # warm-up: first-call overheads out of both timings
    batched_time = naive_time = 0.0
    worst = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        batched = preference_prompt(model, prompt, candidates, settings)
        batched_time += time.perf_counter() - start
        print(f"{prompt.sample_id}: batched {batched_time:.1f}s (cumulative); now the naive way", flush=True)
        start = time.perf_counter()
        naive = preferences_one_trial_at_a_time(model, prompt, candidates, settings.budget, settings.probe_tokens)
        naive_time += time.perf_counter() - start
        worst = max(worst, float(np.abs(batched - naive).max() / max(naive.max(), 1e-12)))
        tokens = len(prompt.context) + len(prompt.probe)
        print(f"{prompt.sample_id}: {tokens} tokens, batched {batched_time:.1f}s, naive {naive_time:.1f}s (cumulative)")
    layers, methods = batched.shape
    print(f"model {source.label}, {len(prompts)} sample(s), {layers} layers x {methods} methods "
          f"({', '.join(specs)}), budget {args.budget}")
    print(f"batched {batched_time:.1f}s  naive {naive_time:.1f}s  max relative KL difference {worst:.2e}")
    print(f"speedup {naive_time / batched_time:.2f}")


if __name__ == "__main__":
    main()
