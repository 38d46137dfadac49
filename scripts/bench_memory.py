"""Peak memory of `ripplekv eval`'s sample loop under --memory-budget, at two prompt lengths.

A random-weight model with Llama-3.1-8B's attention geometry (32 query / 8 KV heads, head dim 128; few
layers, a small MLP), one offline-suite prompt per length, and 89 variants at B=2048 through the real
`evaluate_sample` (divergence decoding): SnapKV, PyramidKV and AdaKV in many window/kernel/pooling forms,
DefensiveKV, Layer-DefensiveKV (a global split), CAKE and more, plus RippleKV with an allocation that keeps
layer 0 whole. Each length runs in a fresh process. Peak = the process's resident high-water mark (VmHWM,
reset at the sample's start, as the prediction line's `peak_memory_bytes`) less the resident size before the
model existed (interpreter and libraries); "not weights" also less the weights' bytes. It prints, per length,
what building every variant at once would hold (their padded entries alone), `peak/bound`, and last the
16k/8k ratio of everything but the weights.

    PYTHONPATH=src python scripts/bench_memory.py [--tokens 8192,16384] [--memory-budget 3GiB] [--layers 2]

`--protocol blockwise` measures the prefill alone instead (`eval --protocol blockwise`, `engine.blockwise`), on the
same model and prompts, each in a fresh process: one method (`--method snapkv`, `--budget 2048`) compressing the
whole prompt once after its prefill, and compressing block by block (`--block-tokens 512`), at each length; the
bound is the first at a prompt of budget + block tokens (what reading and compressing B + b tokens at once takes,
which is also a block-wise prefill's first read). A prefill's memory is its peak
resident set less the resident set just before it ran (interpreter, libraries, weights, the prompt). It prints each
against the bound and the most entries one (layer, KV head) held (B + b at most block by block, n whole); PASS when
every block-wise prefill is within the bound and the whole-prompt prefill of the longest prompt is over it.

    PYTHONPATH=src python scripts/bench_memory.py --protocol blockwise --tokens 16384 [--budget 2048] [--block-tokens 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

BUDGET = 2048
# The blockwise children's glibc hands every freed block over 1 MiB back at once (eval's 16 MiB would leave a
# block-wise prefill's many smaller blocks resident as heap), so a resident set follows what is alive.
LIVE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_TRIM_THRESHOLD_": str(2**20)}


def specs() -> list[str]:
    """88 method specs at one budget (head splits, a global split, many scorer settings)."""
    chosen = []
    for window in (16, 32, 64):  # kernel=1 pools nothing, so it takes no pooling= (presets.check_used): 3..9
        for kernel in (3, 5, 7, 9):
            for pooling in ("max", "avg"):
                chosen.append(f"snapkv:window={window}:kernel={kernel}:pooling={pooling}")
        for kernel in (3, 5, 7, 9):
            for pooling in ("max", "avg"):
                chosen.append(f"adakv:window={window}:kernel={kernel}:pooling={pooling}")
        for kernel in (1, 5, 7):
            chosen.append(f"pyramidkv:window={window}:kernel={kernel}")
            chosen.append(f"pyramidkv:window={window}:kernel={kernel}:split=adakv")
        chosen += [f"defensivekv:window={window}", f"layer-defensivekv:window={window}", f"cake:window={window}",
                   f"criticalkv:window={window}", f"criticaladakv:window={window}"]
    chosen += ["streamingllm", "random", "tova", "knorm", "keydiff", "snapkv", "uniform"]
    return chosen


def one_length(args) -> dict:
    """Run one sample at `args.one` tokens in this process; returns the measured figures."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ripplekv.engine.memory import format_bytes, parse_bytes, resident_peak, tensor_bytes
    from ripplekv.engine.models import load_tokenizer
    from ripplekv.methods import make_method
    from ripplekv.pipeline.evaluate import SampleSettings, Wanted, evaluate_sample
    from ripplekv.tasks import get_tasks, load_samples

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    task = dataclasses.replace(get_tasks("offline", ["niah"])[0], max_new_tokens=args.new_tokens)
    record = load_samples(task, tokenizer, limit=1, target_tokens=args.one)[0]
    base = resident_peak()  # interpreter, libraries and the tokenizer: before any weight exists
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=4 * args.one, rope_theta=500000.0)
    model = LlamaForCausalLM(config).eval()
    weights = tensor_bytes(model)
    allocation = f"/tmp/bench_memory_whole_{args.layers}.csv"
    with open(allocation, "w", encoding="ascii") as fh:
        fh.write("layer,multiplier\n" + "".join(f"{i},{10.0 if i == 0 else 1.0}\n" for i in range(args.layers)))
    labels = specs()
    methods = {"full": make_method("full"), **{label: make_method(label) for label in labels}}
    methods["ripplekv"] = make_method("ripplekv", shared={"allocation": allocation})
    whole = int(0.6 * args.one)  # with layer 0 weighted 10x, it is clamped at the prompt: kept whole
    variants = [(label, BUDGET) for label in labels] + [("ripplekv", whole)]
    bound = parse_bytes(args.memory_budget)
    started = time.perf_counter()
    rows = evaluate_sample(model, tokenizer, task, record, methods, (BUDGET, whole),
                           SampleSettings(max_length=4 * args.one, memory_budget=bound), sid="bench",
                           wanted=Wanted(variants))
    seconds = time.perf_counter() - started
    entry = config.num_key_value_heads * 2 * 128 * 4
    at_once = sum(entry * sum(max(h) for h in row.get("head_budgets", [[b] * 8 for b in row["layer_budgets"]]))
                  for row in rows if row["method"] != "full")
    kept_whole = [r for r in rows if r["method"] == "ripplekv"][0]["layer_budgets"][0] == rows[0]["compressed_tokens"]
    peak = rows[0]["peak_memory_bytes"] - base
    figures = {"tokens": rows[0]["prompt_tokens"], "variants": len(rows) - 1, "peak": peak, "bound": bound,
               "not_weights": peak - weights, "weights": weights, "all_at_once": at_once, "seconds": seconds,
               "layer_kept_whole": kept_whole}
    print(f"  {figures['tokens']} tokens, {figures['variants']} variants (one keeps layer 0 whole: {kept_whole}): "
          f"peak {format_bytes(peak)} of --memory-budget {format_bytes(bound)} (peak/bound {peak / bound:.3f}); "
          f"weights {format_bytes(weights)}; building all variants at once: {format_bytes(at_once)} of entries; "
          f"{seconds:.0f} s", file=sys.stderr)
    return figures


def one_prefill(args) -> dict:
    """One prefill in this process: `args.prefill` "whole" or "blockwise", of a prompt of `args.one` tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ripplekv.engine.blockwise import blockwise_prefill
    from ripplekv.engine.malloc import allow_keeping
    from ripplekv.engine.memory import PeakMemory, format_bytes
    from ripplekv.engine.models import load_tokenizer
    from ripplekv.engine.prefill import prefill_for
    from ripplekv.methods import make_method
    from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    task = get_tasks("offline", ["niah"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=args.one + args.one // 4)[0]
    ids = torch.tensor(build_prompt_ids(task, record, tokenizer, 4 * args.one)[: args.one])  # exactly args.one
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=4 * args.one, rope_theta=500000.0)
    model = LlamaForCausalLM(config).eval()
    method = make_method(args.method)
    allow_keeping(False)  # as eval's sample under a memory budget: no freed block kept for reuse
    meter = PeakMemory(torch.device("cpu"))  # its origin: the resident set now (interpreter, libraries, weights)
    if args.prefill == "whole":
        state = prefill_for(model, ids, method.requirements())
        method.compress(state, args.budget)  # with-question's eviction, once after the whole prompt
        held = state.length
    else:
        done = blockwise_prefill(model, ids, method, args.budget, args.block_tokens, method.requirements())
        held = done.peak_entries
    figures = {"kind": args.prefill, "tokens": len(ids), "memory": meter.peak() - meter.origin, "held": held}
    print(f"  {args.prefill} prefill of {len(ids)} tokens: {format_bytes(figures['memory'])}, at most {held} "
          "entries per (layer, KV head)", file=sys.stderr)
    return figures


def blockwise_main(args) -> None:
    """`--protocol blockwise`: the bound, then the whole-prompt and block-wise prefill at each length (see above)."""
    def child(kind: str, tokens: int) -> dict:
        command = [sys.executable, __file__, "--one", str(tokens), "--prefill", kind, "--layers", str(args.layers),
                   "--hidden", str(args.hidden), "--threads", str(args.threads), "--method", args.method,
                   "--budget", str(args.budget), "--block-tokens", str(args.block_tokens)]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env={**os.environ, **LIVE_MALLOC})
        return json.loads(done.stdout.strip().splitlines()[-1])

    bound = child("whole", args.budget + args.block_tokens)["memory"]
    print(f"bound: the whole-prompt prefill and compression of budget + block = {args.budget + args.block_tokens} tokens, "
          f"{bound / 2**20:.1f} MiB ({args.method}, B={args.budget}, block {args.block_tokens}, {args.layers} layers)")
    lengths = [int(t) for t in args.tokens.split(",")]
    within, over = True, False
    for tokens in lengths:
        whole, blocks = child("whole", tokens), child("blockwise", tokens)
        within = within and blocks["memory"] <= bound and blocks["held"] <= args.budget + args.block_tokens
        over = whole["memory"] > bound
        print(f"{tokens} tokens: whole-prompt prefill {whole['memory'] / 2**20:.1f} MiB (peak/bound "
              f"{whole['memory'] / bound:.3f}, {whole['held']} entries per head); block-wise "
              f"{blocks['memory'] / 2**20:.1f} MiB (peak/bound {blocks['memory'] / bound:.3f}, at most "
              f"{blocks['held']} entries per head)")
    print(f"{'PASS' if within and over else 'FAIL'}: block-wise within the bound at every length, the whole-prompt "
          f"prefill of {lengths[-1]} tokens over it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--memory-budget", default="3GiB")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--protocol", choices=("eval", "blockwise"), default="eval",
                        help="eval: the sample loop's peak under --memory-budget; blockwise: the prefill alone, "
                             "whole-prompt vs block-wise against the bound (one prefill per variant block-wise)")
    parser.add_argument("--method", default="snapkv", help="with --protocol blockwise: the method evicting per block")
    parser.add_argument("--budget", type=int, default=BUDGET, help="with --protocol blockwise: B")
    parser.add_argument("--block-tokens", type=int, default=512, help="with --protocol blockwise: tokens per block")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process: one length
    parser.add_argument("--prefill", default=None, help=argparse.SUPPRESS)  # a blockwise child: whole or blockwise
    args = parser.parse_args()
    if args.one is not None and args.prefill is not None:
        print(json.dumps(one_prefill(args)))
        return
    if args.protocol == "blockwise":
        blockwise_main(args)
        return
    if args.one is not None:
        print(json.dumps(one_length(args)))
        return
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        command = [sys.executable, __file__, "--one", str(tokens), "--memory-budget", args.memory_budget,
                   "--layers", str(args.layers), "--hidden", str(args.hidden), "--new-tokens", str(args.new_tokens),
                   "--threads", str(args.threads)]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for one in results:
        print(f"{one['tokens']} tokens: peak/bound {one['peak'] / one['bound']:.3f} "
              f"({one['peak'] / 2**30:.2f} / {one['bound'] / 2**30:.2f} GiB; all variants at once would hold "
              f"{one['all_at_once'] / 2**30:.2f} GiB of entries)")
    if len(results) >= 2:
        ratio = results[-1]["not_weights"] / results[0]["not_weights"]
        print(f"not-weights ratio {results[-1]['tokens']}/{results[0]['tokens']} tokens: {ratio:.2f} "
              f"({'PASS' if ratio <= 2.1 and all(r['peak'] <= r['bound'] for r in results) else 'FAIL'}: "
              "peak under the bound, ratio at most 2.1)")


if __name__ == "__main__":
    main()
