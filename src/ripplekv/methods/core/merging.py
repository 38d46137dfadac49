"""Merge on evict (`METHOD:merge=kvpress|cam`): the entries a method evicts are folded into the values of those it
keeps, so the cache holds the same number of entries (the method's exact budgets) carrying more of the prompt.
Keys are left as they are (their RoPE is untouched); the evicted entries are every position the layer holds that
the head does not keep.

- `kvpress`: kvpress's `MergingPress` (after ToMe, Bolya et al. 2023, and D2O, Wan et al. 2024), at its defaults
  (no similarity threshold, every evicted entry merged): an evicted entry goes to the kept entry whose key is most
  alike (cosine), with weight `max(cos, 0) x |v_e| / (|v_e| + |v_t|)`; a kept value becomes
  `(v_t + sum w v_e) / (1 + sum w)`.
- `cam`: CaM (Zhang et al., ICML 2024; kvpress `CAMPress`): an evicted entry is spread evenly over the next
  `CAM_NEIGHBOURS` kept entries after it (fewer at the prompt's end), scaled by `min(1, A_e / mean A_targets)`,
  added to their values. CaM's A is the attention a token has received; here, at the prompt's end, it is the
  observation window's attention (the last 32 queries', summed, averaged over the query heads sharing the KV
  head). Two deliberate differences from kvpress's decoding-time press: CaM draws each merge with that
  probability (a Bernoulli sample), ours adds its expectation, so a result does not depend on a random draw;
  and the eviction is the method's own, per head (kvpress's press evicts one set per layer, by the heads' mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import entries as kv_entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.methods.core.wrapped import Wrapped, held_positions

CAM_NEIGHBOURS = 32  # kvpress CAMPress's merge_budget
CAM_WINDOW = 32  # the observation window whose attention stands for CaM's accumulated attention
EPSILON = 1e-6  # kvpress MergingPress's guard for norms


def window_mass(state: PrefillState, layer: int) -> torch.Tensor:
    """[H_kv, n] float32: the attention the last CAM_WINDOW prompt queries pay each key, summed over them and
    averaged over the query heads of each KV head (once per prefill)."""
    return state.memo((window_mass, layer), lambda: _window_mass(state, layer, min(CAM_WINDOW, state.length)))


def _window_mass(state: PrefillState, layer: int, window: int) -> torch.Tensor:
    queries = state.window_queries(layer, window, "merge=cam").float()  # [H_q, w, d]
    keys = state.keys[layer].float()  # [H_kv, n, d]
    heads, length = keys.shape[0], keys.shape[1]
    group = queries.shape[0] // heads
    logits = queries.reshape(heads, group * window, -1) @ keys.transpose(-1, -2) * state.scaling
    at = length - window + torch.arange(window, device=keys.device)  # each window query's own position
    seen = torch.arange(length, device=keys.device)[None, :] <= at[:, None]
    limit = state.windows[layer] if getattr(state, "windows", None) else None
    if limit is not None:  # a sliding layer's queries see only its window
        seen &= torch.arange(length, device=keys.device)[None, :] > at[:, None] - limit
    logits = logits.masked_fill(~seen.repeat(group, 1), float("-inf"))
    return torch.softmax(logits, dim=-1).view(heads, group, window, length).sum(2).mean(1)


def merge_by_similarity(kept_keys, kept_values, evicted_keys, evicted_values) -> torch.Tensor:
    """MergingPress's rule for one head: the kept values [c, d] (float32) with the evicted ones folded in."""
    if len(evicted_keys) == 0 or len(kept_keys) == 0:
        return kept_values
    kept_unit = kept_keys / kept_keys.norm(dim=-1, keepdim=True).clamp(min=EPSILON)
    evicted_unit = evicted_keys / evicted_keys.norm(dim=-1, keepdim=True).clamp(min=EPSILON)
    similarity, target = (evicted_unit @ kept_unit.T).max(dim=-1)
    evicted_norm = evicted_values.norm(dim=-1)
    weight = similarity.clamp(min=0) * evicted_norm / (evicted_norm + kept_values.norm(dim=-1)[target] + EPSILON)
    added = torch.zeros_like(kept_values).index_add_(0, target, weight[:, None] * evicted_values)
    total = torch.zeros(len(kept_values), dtype=kept_values.dtype, device=kept_values.device).index_add_(0, target, weight)
    merged = (kept_values + added) / (1 + total)[:, None]
    return torch.where((total > 0)[:, None], merged, kept_values)


def merge_into_neighbours(kept_positions, kept_values, evicted_positions, evicted_values, mass) -> torch.Tensor:
    """CaM's rule for one head, in expectation: kept values [c, d] (float32; `kept_positions` ascending) with each
    evicted value spread over the next CAM_NEIGHBOURS kept entries after it; `mass` [n] the head's attention."""
    count = len(kept_positions)
    if len(evicted_positions) == 0 or count == 0:
        return kept_values
    start = torch.searchsorted(kept_positions, evicted_positions, right=True)
    slots = start[:, None] + torch.arange(CAM_NEIGHBOURS, device=start.device)[None, :]
    valid = slots < count
    slots = slots.clamp(max=count - 1)
    targets = valid.sum(-1)
    mean = (mass[kept_positions[slots]] * valid).sum(-1) / targets.clamp(min=1)
    probability = mass[evicted_positions] / mean
    probability = torch.nan_to_num(probability, nan=0.0, posinf=1.0).clamp(0, 1)
    scale = torch.where(targets > 0, probability / targets.clamp(min=1), torch.zeros_like(probability))
    spread = (scale[:, None, None] * evicted_values[:, None, :]) * valid[..., None]
    return kept_values.index_add(0, slots.reshape(-1), spread.reshape(-1, kept_values.shape[-1]))


@dataclass(frozen=True)
class Merged(Wrapped):
    """The method's entries, each evicted value folded into the kept ones by `rule` (see the module's docstring)."""

    rule: str = "kvpress"

    option = "merge"

    def own(self) -> dict:
        return {"rule": self.rule, **({"neighbours": CAM_NEIGHBOURS, "window": CAM_WINDOW} if self.rule == "cam" else {})}

    def requirements(self) -> Requirements:
        own = Requirements(capture_window=CAM_WINDOW) if self.rule == "cam" else Requirements()
        return self.inner.requirements().union(own)

    def rewrite(self, state: PrefillState, layer: int, built: kv_entries.LayerEntries) -> kv_entries.LayerEntries:
        start, length = held_positions(state, layer)
        if bool((built.counts >= length - start).all()):
            return built  # nothing evicted in this layer
        keys, values = state.keys[layer], state.values[layer]
        merged_values = built.values.clone()
        mass = window_mass(state, layer) if self.rule == "cam" else None
        for head, count in enumerate(built.counts.tolist()):
            positions = built.positions[head, :count]
            order = positions.argsort()
            kept = positions[order]
            evicted = torch.ones(length, dtype=torch.bool, device=kept.device)
            evicted[:start] = False
            evicted[kept] = False
            gone = torch.nonzero(evicted).flatten()
            kept_values = built.values[head, :count][order].float()
            if self.rule == "kvpress":
                new = merge_by_similarity(built.keys[head, :count][order].float(), kept_values,
                                          keys[head, gone].float(), values[head, gone].float())
            else:
                new = merge_into_neighbours(kept, kept_values, gone, values[head, gone].float(), mass[head])
            merged_values[head, order] = new.to(built.values.dtype)
        return kv_entries.LayerEntries(built.keys, merged_values, built.positions, built.counts, built.log_weights,
                                       built.spans)
