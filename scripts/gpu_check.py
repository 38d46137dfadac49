"""The GPU check: one run (under 10 minutes on an H200) that writes a JSON of pass/fail against thresholds.

Big: an 8B-shaped random-weight Llama made on the GPU (32 layers, 32 query / 8 KV heads, d 128, llama3 rope
scaling, a 128k vocabulary, bfloat16) prefills a 16-32k-token random prompt, decodes the full reference, then
~40 variants (AdaKV, DefensiveKV and global splits at B=128 and 2048, one keeping layer 0 whole) through
divergence decoding, built as their groups run within `--memory-budget`; each phase's peak (CUDA allocator)
must stay under it. It records the decoding cost constants its groups were planned with, measured on the GPU at
the first plan (`engine.decode_costs`). Small equalities (also on CPU, `--small-only`): one variant alone equals it in a batch of
16; H2O's accumulated sums equal a materialized attention map at 2k tokens; kept sets are the same on CPU
and GPU (GPU only); a tiny Qwen3's captured keys equal the model's own cache.

    python scripts/gpu_check.py [--out gpu_check.json] [--tokens 32768] [--memory-budget 48GiB] [--small-only]

Without CUDA (and without --small-only) it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch

from ripplekv.engine import adapter
from ripplekv.engine.decode import full_reference
from ripplekv.engine.decode_costs import costs_for
from ripplekv.engine.divergence import decode_by_divergence
from ripplekv.engine.memory import parse_bytes
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.schedule import Decoding, SampleMemory, Variant, decode_variants
from ripplekv.methods import make_method
from ripplekv.methods.signals.column_sums import COLUMN_SUMS

BIG_SPECS = [f"{name}:window={w}" for w in (32, 64)
             for name in ("adakv", "defensivekv", "layer-defensivekv", "snapkv", "cake")] + \
    ["pyramidkv:split=adakv", "pyramidkv", "streamingllm", "tova", "knorm", "criticaladakv", "keydiff", "random",
     "expected-attention", "snapkv:split=adakv"]


def check(results: list, name: str, passed: bool, value, threshold) -> None:
    results.append({"check": name, "pass": bool(passed), "value": value, "threshold": threshold})
    print(f"{'PASS' if passed else 'FAIL'} {name}: {value} (threshold {threshold})", file=sys.stderr, flush=True)


def random_ids(count: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))


def decode_all(model, ids, methods: dict, variants: list, bound: int, max_new: int, phases: dict | None = None,
               batch: int = 16):
    """What `evaluate_sample` does to one prompt, phase by phase: prefill, full reference, then the engine's
    variant schedule (`schedule.decode_variants`: groups within what `bound` leaves, built when they decode).
    `phases` collects each phase's CUDA peak. Returns (state, tokens and fidelity per variant, kept lengths)."""
    cuda = ids.device.type == "cuda"

    def phase(name):
        if cuda and phases is not None:
            torch.cuda.synchronize()
            phases[name] = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    memory = SampleMemory(model, bound)
    state = prefill_for(model, ids, Requirements.of_all(methods.values()), reserve=max_new)
    phase("prefill")
    reference = full_reference(model, state, max_new)
    phase("reference")
    chosen = [Variant(label, budget, methods[label]) for label, budget in variants]
    decoded = decode_variants(model, state, reference, chosen, Decoding(max_new, batch), memory)
    phase("variants")
    result = SimpleNamespace(tokens=[d.tokens for d in decoded], fidelity=[d.fidelity for d in decoded])
    return state, result, [[int(c) for c in d.counts.max(1)] for d in decoded]


def big_check(results: list, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    bound = parse_bytes(args.memory_budget)
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    torch.cuda.reset_peak_memory_stats()
    allocation = "/tmp/gpu_check_whole.csv"
    with open(allocation, "w", encoding="ascii") as fh:
        fh.write("layer,multiplier\n" + "".join(f"{i},{40.0 if i == 0 else 1.0}\n" for i in range(32)))
    methods = {spec: make_method(spec) for spec in BIG_SPECS}
    methods["ripplekv"] = make_method("ripplekv", shared={"allocation": allocation})
    whole = int(0.1 * args.tokens)  # layer 0 weighted 40x: clamped at the prompt, kept whole
    variants = [(spec, b) for spec in BIG_SPECS for b in (128, 2048)] + [("ripplekv", whole)]
    phases: dict = {}
    ids = random_ids(args.tokens, config.vocab_size).cuda()
    state, result, lengths = decode_all(model, ids, methods, variants, bound, args.new_tokens, phases)
    for name, peak in phases.items():
        check(results, f"peak memory, {name} ({args.tokens} tokens, {len(variants)} variants)", peak <= bound,
              f"{peak / 2**30:.2f} GiB", f"<= {bound / 2**30:.2f} GiB")
    check(results, "a variant keeps layer 0 whole", lengths[-1][0] == state.length, lengths[-1][0], state.length)
    finite = all(f is not None and f.kl == f.kl for f in result.fidelity)
    check(results, "every variant decoded with a finite KL", finite and all(result.tokens), len(result.tokens),
          len(variants))
    check(results, "big run time", True, f"{time.perf_counter() - started:.0f} s", "(recorded)")
    costs = costs_for(model, state)  # what its decoding planned with: measured on this device (engine.decode_costs)
    check(results, "decoding cost constants", True,
          f"{costs.step_ms:.3g} ms a step, {costs.variant_ms:.3g} a variant, {costs.entry_ms:.3g} an entry", "(recorded)")
    del model, state, result
    torch.cuda.empty_cache()


def tiny_llama(device, dtype=torch.float32, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=503, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def small_checks(results: list, device: str) -> None:
    """Equalities at tiny size: on `device`, and kept sets on CPU against it when it is a GPU."""
    model = tiny_llama(device)
    ids = random_ids(600, 503, seed=3).to(device)
    names = ("snapkv", "adakv", "defensivekv", "layer-defensivekv", "streamingllm")
    methods = {name: make_method(name) for name in names}
    variants = [(name, b) for name in names for b in (8, 16, 32)] + [("snapkv", 64)]
    state, batched, _ = decode_all(model, ids, methods, variants, 2**34, 12)
    reference = full_reference(model, state, 12)
    alone = [decode_by_divergence(model, state, [methods[n].compress(state, b)], reference, 12) for n, b in variants]
    same_tokens = all(a.tokens[0] == t for a, t in zip(alone, batched.tokens))
    gap = max(abs(a.fidelity[0].kl - f.kl) for a, f in zip(alone, batched.fidelity))
    check(results, f"one variant alone = in a batch of {len(variants)}: tokens", same_tokens, same_tokens, True)
    check(results, "one variant alone = in a batch: KL", gap <= 1e-4, f"{gap:.2e}", "<= 1e-4")

    h2o_ids = random_ids(2048, 503, seed=4).to(device)
    h2o = prefill_for(tiny_llama(device, layers=2), h2o_ids, Requirements(signals={COLUMN_SUMS}))
    eager = tiny_llama(device, layers=2)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        maps = eager(input_ids=h2o_ids[None], output_attentions=True).attentions
    worst = 0.0
    for layer, attention in enumerate(maps):  # [1, H_q, n, n] -> summed over queries, mean over a KV head's group
        sums = attention[0].float().sum(1).view(h2o.num_kv_heads, -1, h2o.length).mean(1)
        worst = max(worst, float((sums - h2o.signal(COLUMN_SUMS)[layer].float()).abs().max() / sums.abs().max()))
    check(results, "H2O sums = a materialized attention map at 2k tokens (relative)", worst <= 1e-4, f"{worst:.2e}",
          "<= 1e-4")

    if torch.device(device).type == "cuda":
        cpu_model, here = tiny_llama("cpu"), prefill_for(model, ids, Requirements.of_all(methods.values()))
        there = prefill_for(cpu_model, ids.cpu(), Requirements.of_all(methods.values()))
        differ = [f"{n}@{b}" for n, b in variants
                  if not torch.equal(methods[n].select(here, b).cpu(), methods[n].select(there, b))]
        check(results, "kept sets on CPU = on the GPU", not differ, differ or "all equal", "all equal")

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=503, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=4096)).to(device).eval()
    q_ids = random_ids(300, 503, seed=5).to(device)
    captured = prefill_for(qwen, q_ids, Requirements(capture_window=32))
    with torch.inference_mode():
        own = qwen(input_ids=q_ids[None], use_cache=True).past_key_values
    worst = max(float((captured.keys[i] - own.layers[i].keys[0]).abs().max()) for i in range(adapter.num_layers(qwen)))
    check(results, "tiny Qwen3: captured keys = the model's own cache", worst <= 1e-5, f"{worst:.2e}", "<= 1e-5")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--memory-budget", default="48GiB")
    parser.add_argument("--small-only", action="store_true", help="only the small equalities (on CPU without CUDA)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small_only:
        print("gpu_check: no CUDA device here; nothing checked (run it on a GPU machine)")
        return 0
    results: list = []
    started = time.perf_counter()
    small_checks(results, "cuda" if cuda else "cpu")
    if cuda and not args.small_only:
        big_check(results, args)
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "seconds": round(time.perf_counter() - started, 1), "pass": all(r["pass"] for r in results),
              "checks": results}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    failed = [r["check"] for r in results if not r["pass"]]
    print(f"gpu_check: {'PASS' if not failed else 'FAIL'} {len(results) - len(failed)}/{len(results)} on "
          f"{report['device']} in {report['seconds']} s" + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
