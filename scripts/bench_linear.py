"""The model's linear layers on a few rows: torch's F.linear against engine.linear's W @ x^T, side by side.

One decoding step's linear work for the bundled model's shapes (every layer's q, k, v, o, gate, up and down
projections, then the LM head), on 1 to --rows rows, random weights. The two ways alternate, --rounds times
each per row count; it prints each one's median milliseconds and their ratio (below 1: W @ x^T is faster),
and marks the row counts engine.linear sends through W @ x^T. Run it alone: the figures share the cores.

    PYTHONPATH=src python scripts/bench_linear.py [--rows 10] [--rounds 8] [--model PATH_OR_ID]
"""

from __future__ import annotations

import argparse
import statistics
import time


def shapes(config) -> list[tuple[int, int]]:
    """(out, in) of every linear a decoding step runs, the LM head last."""
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    queries = config.num_attention_heads * head_dim
    layer = [(queries, hidden), (kv, hidden), (kv, hidden), (hidden, queries), (inner, hidden), (inner, hidden),
             (hidden, inner)]
    return layer * config.num_hidden_layers + [(config.vocab_size, hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10, help="time 1 to this many rows")
    parser.add_argument("--rounds", type=int, default=8, help="timed steps of each way per row count")
    parser.add_argument("--model", default=None, help="model whose shapes to use (default: the bundled one)")
    args = parser.parse_args()
    if args.rows < 1 or args.rounds < 1:
        parser.error("--rows and --rounds must be at least 1")

    import torch
    import torch.nn.functional as F

    from ripplekv.engine.linear import FEW_ROWS, by_columns
    from ripplekv.engine.models import load_config

    weights = [torch.randn(out, into) for out, into in shapes(load_config(args.model))]

    def step(rows: int, few: bool, inputs) -> float:
        start = time.perf_counter()
        way = by_columns if few else F.linear
        for x, w in zip(inputs, weights):
            way(x, w)
        return time.perf_counter() - start

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(weights)} linears per step")
    print("rows  F.linear_ms  W@xT_ms  ratio  engine uses")
    for rows in range(1, args.rows + 1):
        inputs = [torch.randn(rows, w.shape[1]) for w in weights]
        step(rows, False, inputs), step(rows, True, inputs)  # warm-up
        times = {False: [], True: []}
        for round_ in range(args.rounds):
            for few in ((False, True) if round_ % 2 == 0 else (True, False)):
                times[few].append(step(rows, few, inputs))
        plain, few = (statistics.median(times[k]) * 1000 for k in (False, True))
        uses = "W@xT" if rows <= FEW_ROWS else "F.linear"
        print(f"{rows:4d}  {plain:11.1f}  {few:7.1f}  {few / plain:5.2f}  {uses}")


if __name__ == "__main__":
    main()
