"""Engine costs on one long prompt: prefill time and peak RSS, and building every method's selection.

Selections for 5 methods x 4 budgets are built from one prefill; their cost is reported as a share of
the prefill time measured in the same run (`selection/prefill X.XX%  peak_rss Y.YY GB`). H2O's
accumulated attention is timed against the plain prefill on the same prompt, alternating the two
`--reps` times after a warm-up and taking each one's fastest run (robust to other load on the machine):
`h2o prefill overhead X` with X = (accumulating - plain) / plain.
The 2025-26 scorers' extra cost per prefill (`--frontier`, on by default): what recording a method's
declared `Requirements` adds to the prefill (alternated with plain prefills, fastest of `--reps` each)
plus its selection at B=128 (fastest of two), over the plain prefill (`<method> extra/prefill X`, target
<= 0.15 for all but KVzip, whose second forward, the reconstruction pass, is reported on its own line).
Requirements that a plain prefill already records (a window within its default capture of 64) add
nothing and are not timed: timing the same prefill twice would report only the machine's jitter.
The cross-layer allocators (`--allocators`, on by default) are timed the same way with their default
scorers (target <= 0.1 of a prefill): SqueezeAttention's includes its recomputed last 64 tokens, the
allocation ceiling's the answer-aware pass over a 16-token stand-in answer; CompressKV's offline profile
is reported on its own line as prefills per calibration prompt (a prefill plus its layer errors).

    .venv/bin/python scripts/bench_engine.py [--tokens 3500] [--reps 3] [--allocation ALLOC.csv] [--model M]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from ripplekv.engine import timings
from ripplekv.engine.models import load_model
from ripplekv.engine.prefill import DEFAULT_CAPTURE_WINDOW, Requirements, prefill
from ripplekv.engine.recorders import SampleContext, record_reference
from ripplekv.methods import make_method
from ripplekv.methods.kvzip import RECONSTRUCTION
from ripplekv.methods.signals.column_sums import COLUMN_SUMS

FRONTIER = ("criticalkv", "criticaladakv", "keydiff", "expected-attention", "defensivekv", "layer-defensivekv", "kvzip")
ALLOCATORS = ("dynamickv", "lava", "squeezeattention", "pyramidinfer", "compresskv", "allocation-ceiling")


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB on Linux


def gracekv_build_ratio(model, ids, state, prefill_time: float, budgets=(64, 128, 256, 512)) -> str:
    """GraceKV's construction time per budget over the time of `state`'s prefill (the same prompt, this run)."""
    method = make_method("gracekv")
    method.compress(prefill(model, ids[:512]), 64)  # warm-up
    ratios = []
    for budget in budgets:
        start = time.perf_counter()
        method.compress(state, budget)
        ratios.append((time.perf_counter() - start) / prefill_time)
    per_budget = ", ".join(f"B={b} {r:.3f}" for b, r in zip(budgets, ratios))
    return f"gracekv build/prefill {max(ratios):.3f} (max over budgets; {per_budget}; prefill {prefill_time:.2f}s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=3500)
    parser.add_argument("--allocation", default=None, help="RippleKV allocation CSV; default: a linear ramp 2..0.5")
    parser.add_argument("--reps", type=int, default=3, help="alternating plain/accumulating prefills for the H2O overhead")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-frontier", action="store_true", help="skip the new scorers' overheads")
    parser.add_argument("--no-allocators", action="store_true", help="skip the cross-layer allocators' overheads")
    args = parser.parse_args()

    model, tokenizer, source = load_model(args.model, device=args.device, dtype=args.dtype)
    num_layers = model.config.num_hidden_layers
    ramp = tuple(2.0 - 1.5 * i / max(1, num_layers - 1) for i in range(num_layers))
    ripple = {"allocation": args.allocation} if args.allocation else {"multipliers": ramp}
    methods = [make_method(name, **(ripple if name == "ripplekv" else {}))
               for name in ("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, len(tokenizer) - 100, (args.tokens,), generator=generator)
    rss_loaded = peak_rss_gb()
    prefill(model, ids[:256])  # warm-up
    start = time.perf_counter()
    state = prefill(model, ids)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    prefill_time = time.perf_counter() - start
    rss_prefill = peak_rss_gb()
    start = time.perf_counter()
    total = {}
    for method in methods:
        for budget in (64, 128, 256, 512):
            total[(method.name, budget)] = sum(layer.total() for layer in method.compress(state, budget))
    select_time = time.perf_counter() - start
    heads = state.num_kv_heads
    for budget in (64, 128, 256, 512):
        kept = {name: total[(name, budget)] for name in ("streamingllm", "snapkv", "pyramidkv", "ripplekv")}
        assert len(set(kept.values())) == 1 and kept["snapkv"] == num_layers * heads * budget, kept
    print(f"model {source.label}, {args.tokens} tokens, {num_layers} layers x {heads} KV heads")
    print(f"prefill {prefill_time:.2f}s; 5 methods x 4 budgets built (entries) in {select_time:.3f}s; totals match L*H*B")
    print(f"peak RSS after loading {rss_loaded:.2f} GB, after prefill {rss_prefill:.2f} GB")
    print(f"selection/prefill {100 * select_time / prefill_time:.2f}%  peak_rss {rss_prefill:.2f} GB")
    print(gracekv_build_ratio(model, ids, state, prefill_time))
    del state
    plain, accumulating = h2o_overhead(model, ids, args.reps)
    print(f"prefill {args.tokens} tokens: plain {plain:.2f}s, accumulating attention (H2O) {accumulating:.2f}s "
          f"(fastest of {args.reps} each, alternating)")
    print(f"h2o prefill overhead {(accumulating - plain) / plain:.3f}")
    if not args.no_frontier:
        for line in frontier_overheads(model, tokenizer, ids, plain, args.reps):
            print(line)
    if not args.no_allocators:
        for line in frontier_overheads(model, tokenizer, ids, plain, args.reps, ALLOCATORS, {"compresskv": {"errors": ramp}}):
            print(line)
        print(compresskv_profile_cost(model, ids, plain))


def frontier_overheads(model, tokenizer, ids, plain: float, reps: int, names=FRONTIER, options=None,
                       budget: int = 128) -> list[str]:
    """Each method's extra time per prefill: what its requirements add to the prefill plus its selection
    (`names`, built with `options[name]` where given; a stand-in answer for those that need one).

    Both parts are measured robustly to other load on the machine: the prefill with a method's
    requirements alternates with a plain one (`reps` each, fastest of each kept; methods that declare the
    same requirements share one measurement; 0 for those a plain prefill records anyway), and the selection
    is the fastest of two from fresh scores (the per-sample scoring that every budget then reuses, plus
    one budget's selection).
    """
    lines, prefill_extra = [], {}
    for name in names:
        method = make_method(name, **(options or {}).get(name, {}))
        needs = method.requirements()
        method.compress(with_answer(prefill(model, ids[:256], requirements=needs, context=SampleContext(tokenizer))), 64)  # warm-up
        if needs not in prefill_extra:
            prefill_extra[needs] = _requirements_extra(model, ids, needs, reps) if records_more(needs) else 0.0
        state = with_answer(prefill(model, ids, requirements=needs, context=SampleContext(tokenizer)))
        selection = []
        for _ in range(1 if name == "kvzip" else 2):  # KVzip's reconstruction pass is too long to repeat
            state.forget()
            start = time.perf_counter()
            with timings.collect(state.device) as spent:
                method.compress(state, budget)
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            selection.append(time.perf_counter() - start)
        extra = prefill_extra[needs] + min(selection)
        lines.append(f"{name} extra/prefill {extra / plain:.3f} (B={budget}; prefill +{prefill_extra[needs]:.2f}s, "
                     f"selection {min(selection):.2f}s, over a {plain:.2f}s prefill)")
        if (RECONSTRUCTION, "") in spent.seconds:
            seconds = spent.seconds[(RECONSTRUCTION, "")]
            lines.append(f"kvzip reconstruction pass {seconds:.2f}s = {seconds / plain:.2f} prefills")
        del state
    return lines


def with_answer(state, tokens: int = 16):
    """The state with a stand-in answer (its last prompt tokens) recorded, for the answer-aware methods."""
    record_reference(state, state.input_ids[-tokens:].tolist())
    return state


def compresskv_profile_cost(model, ids, plain: float, budget: int = 128) -> str:
    """CompressKV's offline profile per calibration prompt (a prefill plus its layer errors), in prefills."""
    from ripplekv.methods.compresskv import calibrate

    calibrate(model, [ids[:256].tolist()], budget)  # warm-up
    start = time.perf_counter()
    calibrate(model, [ids.tolist()], budget)
    seconds = time.perf_counter() - start
    return f"compresskv offline profile {seconds:.2f}s = {seconds / plain:.2f} prefills per calibration prompt (once per model)"


def records_more(needs: Requirements) -> bool:
    """Whether a prefill with `needs` does more than a plain one (which captures DEFAULT_CAPTURE_WINDOW queries);
    keeping what the sample brings (its tokenizer, its answer) costs nothing."""
    from ripplekv.engine.recorders import RECORDERS, FromSample

    watching = {name for name in needs.signals if not issubclass(RECORDERS[name], FromSample)}
    return watching != set() or needs.capture_window > DEFAULT_CAPTURE_WINDOW


def _requirements_extra(model, ids, needs, reps: int) -> float:
    """Fastest prefill recording `needs` minus the fastest plain one, run alternately (0 when it is faster)."""
    plain, recording = fastest_alternating(model, ids, reps, requirements=needs)
    return max(0.0, recording - plain)


def h2o_overhead(model, ids, reps: int) -> tuple[float, float]:
    """Fastest plain and fastest accumulating prefill of the same prompt, run alternately."""
    h2o = Requirements(signals={COLUMN_SUMS})
    prefill(model, ids[:256], requirements=h2o)  # warm-up of the accumulating path
    return fastest_alternating(model, ids, reps, requirements=h2o)


def fastest_alternating(model, ids, reps: int, **recording) -> tuple[float, float]:
    """Fastest plain prefill and fastest prefill with `recording` (prefill's keyword arguments), alternated
    `reps` times so that load on the machine falls on both alike."""
    times = {False: [], True: []}
    for rep in range(max(1, reps)):
        for recorded in ((False, True) if rep % 2 == 0 else (True, False)):
            start = time.perf_counter()
            prefill(model, ids, **(recording if recorded else {}))
            times[recorded].append(time.perf_counter() - start)
    return min(times[False]), min(times[True])


if __name__ == "__main__":
    main()
