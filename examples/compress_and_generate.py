"""Compress a prompt's KV cache with RippleKV and SnapKV, then answer with plain `model.generate`.

    python examples/compress_and_generate.py [--budget 64]

The cache keeps `budget` entries per layer per KV head on average (RippleKV spreads them by layer
sensitivity; the bundled model ships its allocation); its tensors really are that small.
A mistake (`--budget 0`) is one line and exit code 2: `ripplekv.UserError` says what to do.
"""

import argparse
import sys

import ripplekv

FACTS = ("The lighthouse keeper wrote in her log every evening. Storms came from the west in autumn. "
         "The supply boat arrived on Thursdays, weather permitting. ") * 6
PROMPT = FACTS + "The keeper's cat was called Marmalade. " + FACTS + "\n\nWhat was the keeper's cat called?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=64)
    args = parser.parse_args()
    model, tokenizer = ripplekv.load_model()  # the bundled SmolLM2-135M-Instruct, offline
    for method in ("ripplekv", "snapkv"):
        cache = ripplekv.compress(model, tokenizer, PROMPT, method=method, budget=args.budget, chat=True)
        output = model.generate(cache.input_ids, cache=cache, max_new_tokens=16, do_sample=False)
        answer = tokenizer.decode(output[0, cache.prompt_length:], skip_special_tokens=True)
        print(f"{method}: kept {cache.kept_entries} of {cache.prompt_length * cache.counts.size} prompt entries "
              f"({cache.prompt_bytes() / 2**20:.1f} MiB): {answer!r}")


if __name__ == "__main__":
    try:
        main()
    except ripplekv.UserError as err:  # your mistake, not a bug: its message says what to do
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
