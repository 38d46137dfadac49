"""H2O scoring: heavy hitters (the most attended entries over the whole prompt) plus recent tokens.

H2O (Zhang et al., 2023), applied once after prefill. An entry's score is the attention it received
from every prompt query: the column sum of the causal attention map, each row a softmax over the keys
that query sees, unnormalised, as the H2O code (`h2o_hf`) and KVCache-Factory sum it. The paper splits
each head's cache evenly between heavy hitters and recent tokens: `recent=0.5` gives the most recent
`floor(0.5 * count)` tokens of a head, the top-scored earlier entries fill the rest.

Options, for the other readings:
- `norm=mean` divides each column by the number of queries that see that key (n - j for key j), the
  mean attention a key received: kvpress's ObservedAttentionPress. `norm=sum` (default) is H2O's.
- `window=W` always keeps at least the last W tokens; `h2o:recent=0:window=32` is KVCache-Factory's
  LongBench setting and our earlier default; `h2o:norm=mean:recent=0` is kvpress's ObservedAttention.

With grouped KV heads, a KV head's score is the mean over the query heads that share it. The sums come
from the one prefill (chunked over queries, see `methods.signals.column_sums`), never an n x n map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_integers, held_only, per_head, register_scorer, top_scored_mask
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from ripplekv.methods.snapkv import WindowScorer

NORMS = ("sum", "mean")


@register_scorer("h2o")
@dataclass(frozen=True)
class H2OScorer(WindowScorer):
    window: int = 0
    recent: float = 0.5
    norm: str = "sum"

    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)
        if not (isinstance(self.recent, (int, float)) and 0 <= self.recent <= 1):
            raise UserError(f"option recent must be a share in [0, 1], got {self.recent!r}")
        if self.norm not in NORMS:
            raise UserError(f"option norm must be one of {', '.join(NORMS)}, got {self.norm!r}")

    def requirements(self) -> Requirements:
        return Requirements(signals={COLUMN_SUMS})  # column sums over every prompt query, no window queries

    def floor(self) -> int:
        return max(self.window, 1)

    def column_scores(self, state, layer) -> torch.Tensor:
        """[H_kv, n]: each key's summed (norm=sum) or mean (norm=mean) attention from the prompt's queries."""
        scores = state.signal(COLUMN_SUMS)[layer].float()
        if self.norm == "mean":
            seen_by = torch.arange(state.length, 0, -1, dtype=scores.dtype, device=scores.device)
            scores = scores / seen_by
        return scores

    def scores(self, state, layer):
        return self.column_scores(state, layer)[:, : state.length - min(self.window, state.length)]

    def decode_policy(self, every: int):
        from ripplekv.methods.core.decoding import Accumulated

        # The mean attention (norm=mean) would need a per-entry query count; only H2O's own sums decode.
        return Accumulated((self.recent, self.window)) if self.norm == "sum" else None

    def recent_count(self, count: int) -> int:
        return min(count, max(self.window, math.floor(self.recent * count)))

    def keep(self, state, layer, counts):
        columns = None

        def build(heads, count):
            nonlocal columns
            if columns is None:
                columns = held_only(state, layer, self.column_scores(state, layer))
            recent = self.recent_count(count)
            return top_scored_mask(columns[heads, : state.length - recent], state.length, recent, count)

        return per_head(counts, build)
