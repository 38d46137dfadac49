"""Side-by-side timing: ripplekv's eval loop against the loop peers use, on the same samples, in one run.

Ours (`ripplekv eval`): per sample ONE prefill, the full cache decoded first, every compressed variant
selected from that prefill and decoded together in batches, plus teacher-forced fidelity for every
variant (work the peer loop does not do at all, so the comparison is conservative).
Peers (KVCache-Factory / kvpress style): for every variant, prefill again, compress, decode with batch
size 1.

Variants: full + snapkv, streamingllm, pyramidkv and ripplekv (or `random` without --allocation) at
budgets 64, 128, 256, 512 = 17 per sample. The last line is exactly `speedup X.XX agreement Y.YYY`, where
agreement is the share of predictions identical between the two loops.

    .venv/bin/python scripts/bench_eval.py [--tasks hotpotqa,niah] [--limit 1] [--target-tokens 2500]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine.decode import greedy_decode, stop_tokens
from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import prefill
from ripplekv.methods import make_method
from ripplekv.pipeline import eval_plan, evaluate
from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peer_loop(model, tokenizer, task, record, methods, budgets, max_length, capture_window) -> list[str]:
    """Predictions in our row order (full, then method x budget), each variant prefilled and decoded alone."""
    ids = build_prompt_ids(task, record, tokenizer, max_length)
    stops = stop_tokens(model, tokenizer, task.stop_at_newline)
    variants = [("full", None)] + [(name, b) for name in methods if name != "full" for b in budgets]
    predictions = []
    for name, budget in variants:
        state = prefill(model, ids, capture_window=capture_window)
        variant = None if budget is None else [methods[name].compress(state, budget)]
        tokens = greedy_decode(model, state, variant, task.max_new_tokens, stops, num_variants=1)[0]
        predictions.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return predictions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: bundled SmolLM2-135M")
    parser.add_argument("--suite", default="offline")
    parser.add_argument("--tasks", default="hotpotqa,niah")
    parser.add_argument("--limit", type=int, default=1, help="samples per task")
    parser.add_argument("--target-tokens", type=int, default=2500)
    parser.add_argument("--max-length", type=int, default=7500)
    parser.add_argument("--budgets", default="64,128,256,512")
    parser.add_argument("--allocation", default=None, help="allocation CSV; without it `random` replaces ripplekv")
    parser.add_argument("--batch-size", type=int, default=EVAL_BATCH_SIZE)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); 1 avoids oversubscription on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    budgets = eval_plan.parse_budgets([args.budgets])
    fourth = "ripplekv" if args.allocation else "random"
    names = ("full", "snapkv", "streamingllm", "pyramidkv", fourth)
    methods = {name: make_method(name, shared={"allocation": args.allocation}) for name in names}
    model, tokenizer, source = load_model(args.model, device=args.device, dtype=args.dtype)
    tasks = get_tasks(args.suite, list(eval_plan.parse_names(args.tasks)))
    work = []
    for task in tasks:
        for index, record in enumerate(load_samples(task, tokenizer, limit=args.limit, target_tokens=args.target_tokens)):
            work.append((task, evaluate.sample_id(record, index, task), record))
    lengths = [len(build_prompt_ids(t, r, tokenizer, args.max_length)) for t, _, r in work]
    variants = 1 + (len(names) - 1) * len(budgets)
    print(f"model {source.label}, {torch.get_num_threads()} threads; {len(work)} samples of {lengths} tokens; "
          f"{variants} variants each ({', '.join(names)} x budgets {list(budgets)})")
    capture = 64

    # Warm-up outside the clock (first-call allocations, thread pools).
    warm = prefill(model, torch.arange(100, 164), capture_window=capture)  # moved to the model's device
    greedy_decode(model, warm, None, 2, num_variants=1)

    start = time.perf_counter()
    ours = []
    for task, sid, record in work:
        t0 = time.perf_counter()
        settings = evaluate.SampleSettings(max_length=args.max_length, batch_size=args.batch_size)
        rows = evaluate.evaluate_sample(model, tokenizer, task, record, methods, budgets, settings, sid=sid)
        ours.append([row["prediction"] for row in rows])
        print(f"  ours  {task.name:<18} {time.perf_counter() - t0:7.1f} s")
    ours_s = time.perf_counter() - start
    print(f"ripplekv eval (one prefill, batched variants, + fidelity): {ours_s:.1f} s; "
          f"peak RSS {peak_rss_mib():.0f} MiB")

    start = time.perf_counter()
    peers = []
    for task, _sid, record in work:
        t0 = time.perf_counter()
        peers.append(peer_loop(model, tokenizer, task, record, methods, budgets, args.max_length, capture))
        print(f"  peers {task.name:<18} {time.perf_counter() - t0:7.1f} s")
    peers_s = time.perf_counter() - start
    print(f"peer loop (prefill + decode per variant, batch 1): {peers_s:.1f} s; "
          f"peak RSS so far {peak_rss_mib():.0f} MiB")

    pairs = [(a, b) for sample_ours, sample_peers in zip(ours, peers) for a, b in zip(sample_ours, sample_peers)]
    same = sum(a == b for a, b in pairs)
    print(f"identical predictions: {same} of {len(pairs)}")
    print(f"speedup {peers_s / ours_s:.2f} agreement {same / len(pairs):.3f}")


if __name__ == "__main__":
    main()
