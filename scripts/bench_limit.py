"""How far `ripplekv eval` is from its one-prefill limit: eval's time per sample over one plain prefill.

Per sample, in one run and side by side: a plain prefill of the prompt (the physical floor of a design
that prefills once; the faster of one just before and one just after the rest), and `evaluate_sample`
exactly as `ripplekv eval` runs it (one prefill, full answer, every method x budget, divergence decoding,
fidelity). The line `eval/prefill X.XX` is the ratio of the summed times. With --compare-plain the sample
is also evaluated with plain decoding (every variant decoded whole, the pre-divergence path) and the share
of identical predictions is printed, with its time ratio.

Default: the 14 methods reproduce ran before the 2025-26 ones (53 variants: x 4 budgets, 3.5k tokens; today's
configs/reproduce.toml has 23, pass them with --methods) with the committed results/ allocation, DepthKV
allocation and route.

`--stages` adds reproduce's other per-sample work on its calibration prompts, each over one plain prefill of
the same tokens, side by side: `profile/prefill` (RippleKV's noise profile, 2 seeds: every layer's
perturbation from one prefill), `profile-evict/prefill` (DepthKV's eviction profile), `route/prefill`
(routing preferences, 30 layers x 5 candidates) and `placements/prefill` (the placement study's 101
assignments on one prompt).

    .venv/bin/python scripts/bench_limit.py [--tasks hotpotqa,niah] [--limit 1] [--compare-plain]
        [--stages eval,profile,profile-evict,route,placements] [--calib-samples 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine.decode import greedy_decode, stop_tokens
from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import prefill
from ripplekv.methods import make_method
from ripplekv.pipeline import eval_plan, evaluate
from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples

STAGES = ("eval", "profile", "profile-evict", "route", "placements")
REPRODUCE = ("full,streamingllm,snapkv,pyramidkv,ripplekv,h2o,tova,knorm,adakv,cake,"
             "depthkv:allocation=results/depthkv.csv,gracekv,routed,routed-ripplekv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: bundled SmolLM2-135M")
    parser.add_argument("--suite", default="offline")
    parser.add_argument("--tasks", default="hotpotqa,niah")
    parser.add_argument("--limit", type=int, default=1, help="samples per task")
    parser.add_argument("--target-tokens", type=int, default=3500)
    parser.add_argument("--max-length", type=int, default=7500)
    parser.add_argument("--budgets", default="64,128,256,512")
    parser.add_argument("--methods", default=REPRODUCE)
    parser.add_argument("--allocation", default="results/allocation.csv")
    parser.add_argument("--route", default="results/route/ROUTE.csv")
    parser.add_argument("--batch-size", type=int, default=EVAL_BATCH_SIZE)
    parser.add_argument("--compare-plain", action="store_true", help="also decode every variant whole and compare")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--stages", default="eval", help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--calib-samples", type=int, default=2, help="calibration prompts for the other stages")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stages = eval_plan.parse_names(args.stages)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")

    budgets = eval_plan.parse_budgets([args.budgets])
    specs = eval_plan.parse_names(args.methods)
    shared = {"allocation": args.allocation, "route": args.route}
    built = [make_method(spec, shared=shared) for spec in dict.fromkeys(("full", *specs))]
    methods = {method.label: method for method in built}
    model, tokenizer, source = load_model(args.model)
    work = []
    for task in get_tasks(args.suite, list(eval_plan.parse_names(args.tasks))):
        for index, record in enumerate(load_samples(task, tokenizer, limit=args.limit, target_tokens=args.target_tokens)):
            work.append((task, evaluate.sample_id(record, index, task), record))
    variants = 1 + (len(methods) - 1) * len(budgets)
    print(f"model {source.label}, {torch.get_num_threads()} threads; {len(work)} samples; {variants} variants each "
          f"({len(methods)} methods x budgets {list(budgets)})")
    warm = prefill(model, torch.arange(100, 164))
    greedy_decode(model, warm, None, 2, num_variants=1)

    if "eval" in stages:
        eval_limit(model, tokenizer, methods, budgets, work, args)
    others = [s for s in stages if s != "eval"]
    if others:
        calibration_limits(model, tokenizer, others, args)


def plain_prefill(model, ids) -> float:
    """Seconds of one plain prefill of `ids`. Each ratio's floor is the faster of one such prefill just
    before and one just after the timed work: one prefill alone swung by 20% between runs on a shared CPU."""
    start = time.perf_counter()
    prefill(model, ids)
    return time.perf_counter() - start


def eval_limit(model, tokenizer, methods, budgets, work, args) -> None:
    """`eval/prefill` (and, with --compare-plain, the share of predictions plain decoding also gives)."""
    totals = {"prefill": 0.0, "eval": 0.0, "plain": 0.0}
    same = pairs = 0
    for task, sid, record in work:
        ids = build_prompt_ids(task, record, tokenizer, args.max_length)
        before = plain_prefill(model, ids)
        times = {}
        runs = {}
        for decoding in ("divergence", "plain") if args.compare_plain else ("divergence",):
            t0 = time.perf_counter()
            settings = evaluate.SampleSettings(max_length=args.max_length, batch_size=args.batch_size,
                                               decoding=decoding)
            runs[decoding] = evaluate.evaluate_sample(model, tokenizer, task, record, methods, budgets, settings,
                                                      sid=sid)
            times["eval" if decoding == "divergence" else "plain"] = time.perf_counter() - t0
        one = times["prefill"] = min(before, plain_prefill(model, ids))
        for key, value in times.items():
            totals[key] += value
        line = f"  {task.name:<16} {len(ids):5d} tokens: prefill {one:6.1f} s, eval {times['eval']:6.1f} s"
        if args.compare_plain:
            matches = [a["prediction"] == b["prediction"] for a, b in zip(runs["divergence"], runs["plain"])]
            same, pairs = same + sum(matches), pairs + len(matches)
            line += f", plain {times['plain']:6.1f} s, identical {sum(matches)}/{len(matches)}"
            for a, b in zip(runs["divergence"], runs["plain"]):
                if a["prediction"] != b["prediction"]:
                    print(f"    differs: {a['method']}@{a['budget']}: {a['prediction']!r} vs plain {b['prediction']!r}")
        print(line)
    if args.compare_plain:
        print(f"identical predictions (divergence vs plain decoding): {same} of {pairs} ({same / pairs:.3f}); "
              f"plain/prefill {totals['plain'] / totals['prefill']:.2f}")
    print(f"eval/prefill {totals['eval'] / totals['prefill']:.2f}")


def calibration_limits(model, tokenizer, stages, args) -> None:
    """Per calibration prompt: each stage's time and one plain prefill of the tokens it prefills."""
    from ripplekv.pipeline.profile import ProfileSettings, profile_prompt
    from ripplekv.pipeline.route import (
        RouteSettings,
        candidate_methods,
        choose_route,
        placement_prompt,
        preference_prompt,
        random_placements,
    )
    from ripplekv.tasks.calibration import calibration_prompts

    noise = ProfileSettings(seeds=2, eta=0.3, probe_tokens=16)
    evict = ProfileSettings(seeds=1, signal="evict", evict_budget=128, probe_tokens=16, measure="kl")
    route = RouteSettings(budget=128, probe_tokens=16, placements=100)
    candidates = candidate_methods(route.methods)
    labels = [method.label for method in candidates]
    stops = stop_tokens(model, tokenizer, False)
    prompts = calibration_prompts(tokenizer, args.calib_samples, 16, args.target_tokens)
    totals = {stage: [0.0, 0.0] for stage in stages}  # stage time, plain prefill time
    for index, prompt in enumerate(prompts):
        for stage in stages:
            ids = torch.as_tensor(prompt.context if stage.startswith("profile") else prompt.context + prompt.probe)
            before = plain_prefill(model, ids)
            if stage == "placements":  # the placement study alone, on the route this prompt's preferences pick
                route_here = choose_route(preference_prompt(model, prompt, candidates, route), labels)
            start = time.perf_counter()
            if stage == "profile":
                profile_prompt(model, prompt, noise, index)
            elif stage == "profile-evict":
                profile_prompt(model, prompt, evict, index)
            elif stage == "route":
                preference_prompt(model, prompt, candidates, route)
            else:
                placement_prompt(model, prompt, candidates, [route_here, *random_placements(route_here, 100, 0)],
                                 route, stops)
            took = time.perf_counter() - start
            one = min(before, plain_prefill(model, ids))
            totals[stage][0] += took
            totals[stage][1] += one
            print(f"  {prompt.sample_id:<40} {stage:<14} {len(ids):5d} tokens: prefill {one:6.1f} s, "
                  f"{stage} {took:6.1f} s")
    for stage, (took, one) in totals.items():
        print(f"{stage}/prefill {took / one:.2f}")


if __name__ == "__main__":
    main()
