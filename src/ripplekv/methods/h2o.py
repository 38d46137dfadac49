"""H2O scoring: heavy hitters (the most attended entries over the whole prompt) plus the recent window.

Our reading of H2O (Zhang et al., 2023) for compression after prefill, as KVCache-Factory applies it to
LongBench: an entry's score is the attention it received from every prompt query (the column sum of the
causal attention map, each row a softmax over the keys that query sees), no pooling; the last `window`
tokens are always kept and the top-scored earlier entries fill the rest. With grouped KV heads, a KV
head's score is the mean over the query heads that share it. The sums come from the one prefill
(`prefill(accumulate=True)`, chunked over queries, see `ripplekv.engine.accumulate`); `ripplekv eval` asks for
them whenever a chosen method needs them. The H2O paper splits the cache evenly between heavy hitters
and recent tokens; we keep the window at 32, as for SnapKV, so the two differ only in how they rank
the prefix (`h2o:window=...` chooses another).
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.base import check_positive, register_scorer
from ripplekv.methods.snapkv import WindowScorer


@register_scorer("h2o")
@dataclass(frozen=True)
class H2OScorer(WindowScorer):
    def __post_init__(self):
        check_positive(window=self.window)

    def requirements(self) -> Requirements:
        return Requirements(accumulated_attention=True)  # column sums over every prompt query, no window queries

    def scores(self, state, layer):
        if state.accumulated is None:
            raise UserError("h2o needs the attention accumulated over the prompt: prefill with accumulate=True")
        window = min(self.window, state.length)
        return state.accumulated[layer][:, : state.length - window]
