"""CurDKV: keep the entries with the largest approximate leverage of their keys and values.

Our reading of "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (CurDKV, arXiv
2509.15038) as kvpress 0.5.5's `CURPress` scores it (read, not copied). A row's leverage in a CUR
decomposition is approximated by its squared norm: k2 = ||k||^2 (post-RoPE as stored: RoPE keeps norms) and
v2 = ||v||^2. With the local approximation (the default) each is divided by its sum over blocks of
`local_window_size` (16) consecutive positions from the prompt's start, so an entry competes with its
neighbours' mass. `leverage_type` combines them: `kv_product` (the default) k2 x v2, `kv_avg` their mean, or
`key` / `value` alone; the result is divided by its sum over the head, and the first `num_sinks` (4) entries
score 1 (above every other: they are always kept). `use_random_leverage=1` first projects keys and values by a
Gaussian d x 20 matrix (entries N(0, 1/20)); kvpress draws it unseeded, ours from a generator seeded with
`seed` + layer on the CPU, so a selection is a function of the prompt.

Unlike kvpress, the last `window` (32) tokens are always kept too: kvpress compresses the context alone, our
with-question protocol compresses the question with it; `cur:window=0` is kvpress's `CURPress` (make
check-references).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.errors import UserError
from ripplekv.methods.compactor import PromptScorer
from ripplekv.methods.core.base import check_integers, check_positive, register_scorer

LEVERAGE_TYPES = ("kv_product", "kv_avg", "key", "value")
RANDOM_RANK = 20  # kvpress's projection width for use_random_leverage


def block_normalized(squares: torch.Tensor, block: int) -> torch.Tensor:
    """[H, n]: each value divided by the sum of its block of `block` consecutive positions (the last block short)."""
    heads, length = squares.shape
    padded = F.pad(squares, (0, -length % block)).view(heads, -1, block)
    return (padded / padded.sum(-1, keepdim=True)).reshape(heads, -1)[:, :length]


def cur_scores(state, layer: int, num_sinks: int, leverage_type: str, use_random_leverage: int,
               use_local_approximation: int, local_window_size: int, seed: int) -> torch.Tensor:
    """CURPress's scores [H_kv, n] of every entry of `layer` (see the module docstring)."""
    keys, values = state.keys[layer].float(), state.values[layer].float()
    if use_random_leverage:
        generator = torch.Generator().manual_seed(seed + layer)
        projection = (torch.randn(keys.shape[-1], RANDOM_RANK, generator=generator) / math.sqrt(RANDOM_RANK)).to(keys.device)
        keys, values = keys @ projection, values @ projection
    k2, v2 = keys.square().sum(-1), values.square().sum(-1)
    if use_local_approximation:
        k2, v2 = block_normalized(k2, local_window_size), block_normalized(v2, local_window_size)
    scores = {"kv_product": lambda: k2 * v2, "kv_avg": lambda: (k2 + v2) / 2, "key": lambda: k2, "value": lambda: v2}[leverage_type]()
    scores = scores / scores.sum(-1, keepdim=True)
    scores[:, :num_sinks] = 1.0
    return scores


@register_scorer("cur")
@dataclass(frozen=True)
class CURScorer(PromptScorer):
    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: int = 0
    use_local_approximation: int = 1
    local_window_size: int = 16
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_positive(local_window_size=self.local_window_size)
        check_integers({"num_sinks": self.num_sinks, "seed": self.seed}, minimum=0)
        if self.leverage_type not in LEVERAGE_TYPES:
            raise UserError(f"option leverage_type must be one of {', '.join(LEVERAGE_TYPES)}, got {self.leverage_type!r}")
        for name in ("use_random_leverage", "use_local_approximation"):
            if getattr(self, name) not in (0, 1):
                raise UserError(f"option {name} must be 0 or 1, got {getattr(self, name)!r}")

    def unused_options(self) -> dict[str, str]:
        unused = {}
        if not self.use_local_approximation:
            unused["local_window_size"] = "use_local_approximation=0 uses no blocks"
        if not self.use_random_leverage:
            unused["seed"] = "use_random_leverage=0 draws nothing"
        return unused

    def every(self, state, layer):
        options = (self.num_sinks, self.leverage_type, self.use_random_leverage, self.use_local_approximation,
                   self.local_window_size, self.seed)
        return state.memo((cur_scores, layer, *options), lambda: cur_scores(state, layer, *options))
