"""The cost of KVgrad's replay with its backward pass, in prefills, beside KVzip's reconstruction pass.

On one offline-suite prompt of about `--tokens` tokens with the bundled model (CPU, float32): the plain prefill
(fastest of `--reps`), then KVgrad's pass (`kvgrad gradient pass`: a forward and a backward per 512-token
chunk) and KVzip's (`kvzip reconstruction`), each timed once (wall seconds) and printed as a multiple
of the prefill; and the peak resident memory before and after KVgrad's pass (ru_maxrss only grows, so the
second number bounds what the pass added on top of the prefill's own peak).

    PYTHONPATH=src .venv/bin/python scripts/bench_replay_passes.py [--tokens 3500] [--reps 2]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.recorders import SampleContext
from ripplekv.methods.kvgrad import GRADIENT_PASS, gradient_scores
from ripplekv.methods.kvzip import RECONSTRUCTION, TOKENIZER, reconstruction_scores
from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=3500)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer, _ = load_model(None, device="cpu", dtype="float32")
    task = get_tasks("offline", ["hotpotqa"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=args.tokens)[0]
    ids = build_prompt_ids(task, record, tokenizer, 7500)
    needs, context = Requirements(signals={TOKENIZER}), SampleContext(tokenizer=tokenizer)
    fastest = float("inf")
    for _ in range(args.reps):
        start = time.perf_counter()
        state = prefill_for(model, ids, needs, context=context)
        fastest = min(fastest, time.perf_counter() - start)
    before = peak_gb()
    spent = {}
    with torch.inference_mode():  # as eval builds a method's entries
        for name, run in ((GRADIENT_PASS, lambda: gradient_scores(state, 4, 512)),
                          (RECONSTRUCTION, lambda: reconstruction_scores(state, 4, 2048))):
            start = time.perf_counter()
            run()
            spent[name] = time.perf_counter() - start
    after = peak_gb()
    print(f"prompt {state.length} tokens, prefill {fastest:.2f}s (fastest of {args.reps})")
    for name, seconds in spent.items():
        print(f"{name}: {seconds:.2f}s = {seconds / fastest:.2f} prefills")
    print(f"peak RSS {before:.2f} GB after the prefills, {after:.2f} GB after both passes")


if __name__ == "__main__":
    main()
