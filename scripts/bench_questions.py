"""What an extra question costs a compressed context, as a fraction of the context's prefill, on the bundled model.

    nice -n 5 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/bench_questions.py \
        [--target-tokens 2000,3500,7000] [--budget 128] [--repeats 2]

One niah_multiquestion sample (three questions over one haystack), its context prefilled once. Side by side, in
alternation, best of --repeats, in CPU seconds of this process (`timed`): the prefill of the context; answering
the first question alone (the full cache's answer, then every variant compressed once and decoded,
`engine.questions`); answering all its questions from that one compression (asked together, in one batch). An
extra question costs (all - first) / (questions - 1); printed as a fraction of the prefill, beside what asking it
by prefilling the context again would cost (1 prefill + one question's answers). Each context length is measured
on its own (default: 2000 tokens, eval's default 3500, and 7000): an extra question's cost hardly grows with the
context (its tokens read through compressed caches, its answers decoded), the prefill's does, so the fraction
falls as the context grows and is reported at each length, not at one chosen for it.
"""

from __future__ import annotations

import argparse
import time

import torch

from ripplekv.engine.decode import stop_tokens
from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.questions import decode_questions, question_references
from ripplekv.engine.schedule import Decoding, SampleMemory, Variant
from ripplekv.methods import make_method
from ripplekv.pipeline.multi_question import question_parts
from ripplekv.tasks import get_tasks, load_samples


def timed(run) -> float:
    """CPU seconds of this process (every torch thread) spent in `run()`: on a machine other jobs share, the wall
    clock measures them too, the process's CPU time only this work."""
    start = time.process_time()
    run()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-tokens", default="2000,3500,7000", help="context lengths, comma-separated")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="snapkv,streamingllm,pyramidkv")
    args = parser.parse_args()
    model, tokenizer, _ = load_model(None, device="cpu", dtype="float32")
    for target_tokens in (int(length) for length in args.target_tokens.split(",")):
        measure(model, tokenizer, target_tokens, args)


def measure(model, tokenizer, target_tokens: int, args) -> None:
    """The three timings on one context of `target_tokens`, and the extra question's share of its prefill."""
    (task,) = get_tasks("offline", ["niah_multiquestion"])
    record = load_samples(task, tokenizer, limit=1, target_tokens=target_tokens)[0]
    ids, questions, _ = question_parts(task, record, tokenizer, 7500, "multi-question")
    variants = [Variant(name, args.budget, make_method(name)) for name in args.methods.split(",")]
    needs = Requirements.of_all(variant.method for variant in variants)
    decoding = Decoding(task.max_new_tokens)
    stops = stop_tokens(model, tokenizer, task.stop_at_newline)  # answers end where eval's do
    state = prefill_for(model, ids, needs)

    def answer(asked) -> None:
        references = question_references(model, state, asked, task.max_new_tokens, stops)
        decode_questions(model, state, references, asked, variants, decoding, SampleMemory(model), stops)

    best = {"prefill": float("inf"), "first": float("inf"), "all": float("inf")}
    for _ in range(args.repeats):
        best["prefill"] = min(best["prefill"], timed(lambda: prefill_for(model, ids, needs)))
        state.forget()  # each answering starts from fresh scores, as a sample does
        best["first"] = min(best["first"], timed(lambda: answer(questions[:1])))
        state.forget()
        best["all"] = min(best["all"], timed(lambda: answer(questions)))
    extra = (best["all"] - best["first"]) / (len(questions) - 1)
    print(f"context {state.length} tokens, {len(questions)} questions ({', '.join(str(len(q)) for q in questions)} "
          f"tokens), {len(variants)} variants at B={args.budget}, torch threads {torch.get_num_threads()}, "
          f"best of {args.repeats}")
    print(f"CPU seconds: prefill {best['prefill']:.2f}  first question {best['first']:.2f}  all {len(questions)} "
          f"{best['all']:.2f}")
    print(f"an extra question: {extra:.2f} CPU s = {extra / best['prefill']:.3f} of a prefill "
          f"(prefilling again for it: {(best['prefill'] + best['first']) / best['prefill']:.2f} prefills)")


if __name__ == "__main__":
    main()
