"""Throughput of `ripplekv eval` on Ray: 2 CPU workers against 1, same samples, one local cluster, one run.

Each worker is a Ray actor with 1 torch thread that loads the model once; units (a sample with all its
variants) are pulled by whichever worker is free. Times are end to end (worker start and model loading
included), the same way for both, so the ratio is what a user sees. The last line is exactly
`throughput ratio X.XX` (samples/s with 2 workers over samples/s with 1); the line before says whether
both runs produced identical predictions.

    .venv/bin/python scripts/bench_scale.py [--tasks hotpotqa,niah] [--limit 3] [--target-tokens 1500]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

from ripplekv.engine.models import load_tokenizer
from ripplekv.pipeline import distributed, eval_plan, evaluate
from ripplekv.runs import resume


def timed_run(plan, samples: list, setup, workers: int) -> tuple[float, list[str]]:
    """Seconds for every sample on `workers` one-thread actors, and the sorted result lines."""
    work = partial(evaluate.sample_rows, plan.settings, plan.methods)
    start = time.perf_counter()
    results = distributed.run_units(samples, setup, work, distributed.Workers(workers, threads=1))
    lines = sorted(json.dumps(row, sort_keys=True) for _, (rows, _) in results for row in rows)
    return time.perf_counter() - start, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: bundled SmolLM2-135M")
    parser.add_argument("--tasks", default="hotpotqa,niah")
    parser.add_argument("--limit", type=int, default=3, help="samples per task")
    parser.add_argument("--target-tokens", type=int, default=1500)
    parser.add_argument("--methods", default="full,snapkv,pyramidkv,streamingllm")
    parser.add_argument("--budgets", default="64,128")
    args = parser.parse_args()

    settings = eval_plan.EvalSettings(
        budgets=eval_plan.parse_budgets([args.budgets]), methods=eval_plan.parse_names(args.methods),
        suite="offline", tasks=eval_plan.parse_names(args.tasks), limit=args.limit, model=args.model,
        target_tokens=args.target_tokens, device="cpu", dtype="float32",
    )
    plan = eval_plan.plan_eval(settings)
    samples = evaluate.load_all_samples(plan, load_tokenizer(args.model))
    setup = partial(distributed.load_model_on_worker, args.model, "cpu", "float32")

    ray = distributed.import_ray(local=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20)
    try:
        one, lines_one = timed_run(plan, samples, setup, 1)
        two, lines_two = timed_run(plan, samples, setup, 2)
    finally:
        ray.shutdown()
    print(f"cores {os.cpu_count()}, samples {len(samples)}, variants per sample {len(resume.variant_keys(plan.config))}")
    print(f"1 worker : {one:7.1f} s  {len(samples) / one:.3f} samples/s")
    print(f"2 workers: {two:7.1f} s  {len(samples) / two:.3f} samples/s")
    print(f"identical predictions {'yes' if lines_one == lines_two else 'NO'}")
    print(f"throughput ratio {one / two:.2f}")


if __name__ == "__main__":
    main()
