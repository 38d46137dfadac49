"""Prefill once with full attention and keep what every compression method needs.

Compressing after a full-attention prefill is what SnapKV, PyramidKV and StreamingLLM do, so one prefill
serves every method and budget: per layer the full K/V (post-RoPE keys, as the model stores them) and the
observation-window queries. Full attention maps are never materialized (tens of GB at 8k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ripplekv import cache as kvcache

DEFAULT_CAPTURE_WINDOW = 64


@dataclass
class PrefillState:
    """Everything a method needs from one prompt's prefill."""

    input_ids: torch.Tensor  # [n]
    keys: list[torch.Tensor]  # per layer [H_kv, n, d]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor]  # per layer [H_q, w, d], the last w prompt tokens' queries
    last_logits: torch.Tensor  # [vocab] next-token logits after the whole prompt
    scaling: float
    scores: dict = field(default_factory=dict)  # method scores shared across methods and budgets

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def num_query_heads(self) -> int:
        return int(self.window_queries[0].shape[0])


@torch.inference_mode()
def prefill(model, input_ids, capture_window: int = DEFAULT_CAPTURE_WINDOW) -> PrefillState:
    """Run the prompt once with full attention; keep K/V, window queries and the last logits."""
    kvcache.install(model)
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    capture: dict = {"window": min(capture_window, len(ids))}
    out = model(input_ids=ids[None], use_cache=True, logits_to_keep=1, ripplekv_capture=capture)
    dyn = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
    num_layers = model.config.num_hidden_layers
    keys = [dyn.layers[i].keys[0] for i in range(num_layers)]
    values = [dyn.layers[i].values[0] for i in range(num_layers)]
    attn = model.model.layers[0].self_attn
    return PrefillState(
        input_ids=ids,
        keys=keys,
        values=values,
        window_queries=[capture[i] for i in range(num_layers)],
        last_logits=out.logits[0, -1].float(),
        scaling=float(attn.scaling),
    )
