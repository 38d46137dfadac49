"""Time per decoded token under `--decode-budget total` against `prompt`, on the bundled model.

    nice -n 19 .venv/bin/python scripts/bench_decode_budget.py [--steps 96] [--budget 128] [--target-tokens 2000]

One paragraph_recall prompt, prefilled once; each method's variant is decoded greedily for --steps tokens
(no stop token) with plain appending (prompt) and with its evictors (total), alternating, best of --repeats.
"""

from __future__ import annotations

import argparse
import time

import torch

from ripplekv.engine.decode import greedy_decode
from ripplekv.engine.evict import attach, capacities
from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.methods import make_method
from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--target-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="snapkv,h2o,tova,streamingllm")
    args = parser.parse_args()
    model, tokenizer, _ = load_model(None, device="cpu", dtype="float32")
    (task,) = get_tasks("offline", ["paragraph_recall"])
    record = load_samples(task, tokenizer, limit=1, target_tokens=args.target_tokens)[0]
    ids = build_prompt_ids(task, record, tokenizer, 7500)
    methods = {name: make_method(name) for name in args.methods.split(",")}
    state = prefill_for(model, ids, Requirements.of_all(methods.values()))
    print(f"prompt {state.length} tokens, B={args.budget}, {args.steps} steps, torch threads {torch.get_num_threads()}")
    for name, method in methods.items():
        built = [method.compress(state, args.budget)]
        caps = [capacities(method.budgets(state, args.budget), args.budget)]
        policy = method.decode_policy(8)
        best = {"prompt": float("inf"), "total": float("inf")}
        for _ in range(args.repeats):
            best["prompt"] = min(best["prompt"], timed(lambda b=built: greedy_decode(model, state, b, args.steps)))
            best["total"] = min(best["total"], timed(lambda b=built, c=caps, p=policy: greedy_decode(
                model, state, b, args.steps, prepare=lambda cache: attach(cache, state, b, p, c))))
        per = {mode: 1000 * seconds / (args.steps - 1) for mode, seconds in best.items()}
        print(f"{name:14s} prompt {per['prompt']:.1f} ms/token  total {per['total']:.1f} ms/token  "
              f"ratio {per['total'] / per['prompt']:.2f}")


if __name__ == "__main__":
    main()
