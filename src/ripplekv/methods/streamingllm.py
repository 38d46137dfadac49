"""StreamingLLM: attention sinks (the first tokens) plus the most recent window, uniform budgets."""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.methods.base import Method, recent_mask, register


@register("streamingllm")
@dataclass(frozen=True)
class StreamingLLM(Method):
    name = "streamingllm"
    sinks: int = 4

    def keep(self, state, layer, count):
        sinks = min(self.sinks, count)
        mask = recent_mask(state.num_kv_heads, state.length, count - sinks)
        mask[:, :sinks] = True
        return mask
