"""Key re-rotation (`METHOD:rerotate=1`, kvpress `KeyRerotationPress`, as in FINCH and transformers' SinkCache): the
kept keys are rotated from their prompt positions to contiguous ones, as if the kept tokens had been the whole prompt.

kvpress rotates a head's c kept keys to positions 0..c-1 and then numbers the new tokens from c. Here new tokens
keep their numbering from the prompt's length n (the engine's one convention), so the kept keys go to n-c..n-1:
RoPE's attention depends on positions only through their differences, so every query meets every kept key at the
same distance as under kvpress's numbering. A head that keeps fewer entries than another (AdaKV's split) ends at
n-1 too. The model's own RoPE does the rotation (`engine.adapter`: back from the key's position, then forward to
its new one, long-context RoPE's scale included), in float32. The entries' recorded positions stay the prompt
positions they came from (what was kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import adapter
from ripplekv.engine import entries as kv_entries
from ripplekv.engine.prefill import PrefillState
from ripplekv.methods.core.wrapped import Wrapped


def contiguous_positions(positions: torch.Tensor, counts: torch.Tensor, length: int) -> torch.Tensor:
    """[H, K] long: each head's kept entries renumbered in prompt order to end at `length - 1` (padding at 0)."""
    capacity = positions.shape[1]
    real = torch.arange(capacity, device=positions.device)[None, :] < counts[:, None]
    rank = torch.where(real, positions, torch.full_like(positions, torch.iinfo(torch.long).max)).argsort(-1).argsort(-1)
    return torch.where(real, length - counts[:, None] + rank, torch.zeros_like(rank))


@dataclass(frozen=True)
class Rerotated(Wrapped):
    """The method's entries with each kept key re-rotated to its contiguous position (see the module's docstring)."""

    option = "rerotate"

    def own(self) -> dict:
        return {"positions": "contiguous, ending at the prompt's last"}

    def rewrite(self, state: PrefillState, layer: int, built: kv_entries.LayerEntries) -> kv_entries.LayerEntries:
        moved = contiguous_positions(built.positions, built.counts, state.length)
        source = built.positions.clamp(min=0)
        if bool(torch.equal(moved, torch.where(built.positions >= 0, source, torch.zeros_like(source)))):
            return built  # every entry already sits where it would move (a layer that keeps its last tokens)
        model = state.model
        keys = built.keys.float()
        cos, sin = adapter.rope_at(model, source, keys, layer)
        plain = adapter.invert_rope(keys, cos, sin, adapter.rope_scale(model, layer))
        cos, sin = adapter.rope_at(model, moved, keys, layer)
        rotated = adapter.apply_rope(plain, cos, sin).to(built.keys.dtype)
        real = torch.arange(built.capacity, device=keys.device)[None, :] < built.counts[:, None]
        rotated = torch.where(real[..., None], rotated, built.keys)
        return kv_entries.LayerEntries(rotated, built.values, built.positions, built.counts, built.log_weights,
                                       built.spans)
