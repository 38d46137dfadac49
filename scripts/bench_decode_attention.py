"""Decoding attention on this device: our op-by-op path against the fused SDPA path, side by side.

For each attention shape (KV heads x query heads per KV head x head dim: the bundled model's and an 8B Llama's),
batch of variants and kept entries, it times one decoding step's attention both ways (`decode_attention.calibrate`:
alternating, medians) and checks that they agree within float tolerance; then prints which path
`decode_attention` would take there (fused only when it takes at most MARGIN of our time). Run it alone.

    PYTHONPATH=src python scripts/bench_decode_attention.py [--device cuda] [--dtype bfloat16] [--rounds 7]
"""

from __future__ import annotations

import argparse

SHAPES = {"smollm2-135m": (3, 3, 64), "llama-8b": (8, 4, 128)}
GRID = [(16, 512), (64, 512), (16, 2048), (64, 2048)]  # (variants, kept entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")

    import torch

    from ripplekv.engine import decode_attention
    from ripplekv.engine.cache import CompressedLayer

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, {torch.get_num_threads()} CPU threads")
    print(f"{'shape':<14} {'variants':>8} {'kept':>6} {'ours_ms':>9} {'fused_ms':>9} {'fused/ours':>10} "
          f"{'max_diff':>9}  path")
    for label, (kv_heads, group, dim) in SHAPES.items():
        for variants, kept in GRID:
            trial = decode_attention.Trial(variants=variants, kept=kept, rounds=args.rounds, calls=args.calls)
            timed = decode_attention.calibrate(device, dtype, kv_heads, group, dim, CompressedLayer, trial)
            diff = agreement(decode_attention, device, dtype, kv_heads, group, dim, variants, kept)
            print(f"{label:<14} {variants:>8} {kept:>6} {timed['ours_ms']:>9.3f} {timed['fused_ms']:>9.3f} "
                  f"{timed['fused_ms'] / timed['ours_ms']:>10.2f} {diff:>9.2e}  {timed['path']}", flush=True)


def agreement(module, device, dtype, kv_heads, group, dim, variants, kept) -> float:
    """The largest difference between the two paths' outputs on a padded synthetic layer."""
    import torch

    from ripplekv.engine.cache import CompressedLayer

    gen = torch.Generator().manual_seed(1)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    bias = torch.zeros(variants, kv_heads, kept)
    bias[1:, :, kept // 2 :] = float("-inf")
    layer = CompressedLayer(draw(variants, kv_heads, kept, dim), draw(variants, kv_heads, kept, dim), bias.to(device),
                            kept)
    layer.update(draw(variants, kv_heads, 8, dim), draw(variants, kv_heads, 8, dim))
    query = draw(variants, kv_heads * group, 1, dim)
    ours = module.our_attention(query, layer, layer.keys, layer.values, dim**-0.5)
    fused = module.fused_attention(query, layer, layer.keys, layer.values, dim**-0.5)
    return float((ours.float() - fused.float()).abs().max())


if __name__ == "__main__":
    main()
