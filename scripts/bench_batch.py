"""Cost of one decoding step against batch size: what decides how many variants to decode together.

Prefills one prompt, builds SnapKV variants at one budget, and times greedy decoding steps for batches of
1, 2, 4, ... variants; prints milliseconds per step and per variant-step for each batch size.

    .venv/bin/python scripts/bench_batch.py [--target-tokens 3500] [--budget 256] [--sizes 1,4,16,56]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import greedy_decode
from ripplekv.engine.divergence import variant_bytes
from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import prefill
from ripplekv.methods import make_method
from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-tokens", type=int, default=3500)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,56")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(None)
    task = get_tasks("offline", ["hotpotqa"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=args.target_tokens)[0]
    state = prefill(model, build_prompt_ids(task, record, tokenizer, 7500))
    variant = make_method("snapkv").compress(state, args.budget)
    each = variant_bytes(build_cache(state, [variant]), args.steps)
    print(f"{state.length} prompt tokens, snapkv@{args.budget}: {each / 2**20:.1f} MiB per variant in a batch")
    for size in (int(s) for s in args.sizes.split(",")):
        # The same entries in distinct objects, so the cache stores them per variant as distinct variants.
        batch = [[dataclasses.replace(layer) for layer in variant] for _ in range(size)]
        greedy_decode(model, state, batch, 2)  # warm-up at this shape
        t0 = time.perf_counter()
        greedy_decode(model, state, batch, args.steps + 1)  # the first token comes from the prefill
        step = (time.perf_counter() - t0) / args.steps
        print(f"batch {size:3d}: {step * 1e3:8.1f} ms per step, {step * 1e3 / size:7.2f} ms per variant-step")


if __name__ == "__main__":
    main()
