"""Peak memory of the engine on a random-weight model shaped like Llama-3-8B (few layers), on any device.

One prefill of a long random prompt, every method x budget built as entries, all variants decoded
together for a few tokens. Peak memory is the CUDA allocator's peak on a GPU, the process's peak RSS on
a CPU. The last line is `memory peak X GiB (weights Y GiB) for L layers, n tokens, V variants`.

    python scripts/bench_memory.py --device cuda [--layers 4] [--tokens 8000]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ripplekv.engine.decode import greedy_decode
from ripplekv.engine.models import resolve_device_dtype
from ripplekv.engine.prefill import prefill
from ripplekv.methods import make_method

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)


def peak_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=None, help="override the hidden size (a CPU smoke run)")
    args = parser.parse_args()
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    shape = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=args.hidden * 3, vocab_size=32000)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(getattr(torch, dtype)).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    ids = torch.randint(0, shape["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    state = prefill(model, ids)
    methods = [make_method(n) for n in ("snapkv", "pyramidkv", "streamingllm", "adakv")]
    variants = [m.compress(state, b) for m in methods for b in (128, 256, 512, 1024)]
    greedy_decode(model, state, None, args.new_tokens, num_variants=1)
    greedy_decode(model, state, variants, args.new_tokens)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(f"{device} {dtype}: {args.layers} layers x {shape['num_key_value_heads']} KV heads, {args.tokens} tokens, "
          f"{len(variants)} variants + full, {args.new_tokens} new tokens each, {elapsed:.1f} s")
    print(f"memory peak {peak_gib(device):.2f} GiB (weights {weights:.2f} GiB) for {args.layers} layers, "
          f"{args.tokens} tokens, {len(variants) + 1} variants")


if __name__ == "__main__":
    main()
