"""Decoding under a total budget: each (layer, KV head) keeps its count while the model writes.

In `--decode-budget total` a variant's cache holds, per (layer, KV head), the entries the method kept from
the prompt and never more: each decoded token joins its head, is read by its own query, and then the head
gives up one entry, the one its method's `DecodePolicy` scores lowest among those it does not protect.
So after every step every head holds exactly its count (`capacity`), and a variant's total is the same
L x H_kv x B as every other method's at the same budget.

Eviction only edits the attention bias (-inf on an entry that left), never the stored keys: a shared
prompt stays shared, and a masked entry weighs exactly zero, as if removed. Slots are in position order
(prompt entries in prompt order, then decoded tokens), which the recency ranks below rely on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ripplekv.engine.entries import LayerEntries
from ripplekv.engine.recorders import WINDOW_QUERIES


@dataclass
class StepView:
    """What a policy sees in one layer at one decoding step (V variants, H KV heads, S slots)."""

    step: int  # tokens fed so far, this one included (1 = the first decoded token)
    weights: torch.Tensor  # [V, H, group, S] float32: this step's attention of the new query (0 on evicted slots)
    held: torch.Tensor  # [V, H, S] bool: entries the head holds, the new token included
    positions: torch.Tensor  # [V, H, S] long: source position (prompt position, or n + t), -1 on padding
    scores: torch.Tensor  # [V, H, S] float32: the policy's scores so far (0 on the new slot)
    capacity: torch.Tensor  # [V, H] long: entries each head keeps
    seen: int  # queries run so far: prompt length + tokens fed
    evictor: LayerEvictor
    rows: torch.Tensor | None = None  # the evictor's variants this view covers (None: all of them)

    def recent_attention(self, window: int) -> torch.Tensor:
        """Attention [V, H, group, w, S] of the last `window` queries (prompt window, then decoded) over the
        held slots, each query seeing only slots at or before its position."""
        return self.evictor.recent_attention(window, self.held, self.positions, self.rows)


class DecodePolicy(Protocol):
    """A method's answer to: which entry does a full head give up while decoding? (see `methods.core.decoding`)"""

    query_window: int  # decoded queries to remember for re-scoring (0: none)

    def initial(self, state, layer: int, positions: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """Scores [V, H, K] of the prompt entries when decoding starts."""
        ...

    def update(self, view: StepView) -> torch.Tensor:
        """Scores [V, H, S] after this step (higher = keep)."""
        ...

    def protected(self, view: StepView) -> torch.Tensor:
        """Bool [V, H, S]: held entries this step may not evict."""
        ...


def _rows(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return tensor if rows is None else tensor.index_select(0, rows)


def recent_rank(held: torch.Tensor) -> torch.Tensor:
    """For each slot, how many held slots come after it (0 = the newest held entry)."""
    held = held.long()
    return held.flip(-1).cumsum(-1).flip(-1) - held


def first_rank(held: torch.Tensor) -> torch.Tensor:
    """For each slot, how many held slots come before it (0 = the oldest held entry)."""
    held = held.long()
    return held.cumsum(-1) - held


class LayerEvictor:
    """One layer's eviction state for the variants of a cache (rows follow `CompressedLayer`'s variants).

    `policies[v]` is variant v's policy: variants of different methods decode in one batch, each group of
    rows that shares a policy scored by it alone."""

    def __init__(self, policies: list[DecodePolicy], state, layer_idx: int, layer, chosen: list[LayerEntries],
                 capacity):
        if any(entry.log_weights is not None for entry in chosen):
            raise ValueError("decoding under a total budget keeps tokens only; merged prototypes cannot be evicted")
        width = layer.prompt_keys.shape[2]
        device = layer.prompt_keys.device
        self.positions = torch.stack([torch.nn.functional.pad(e.positions, (0, width - e.capacity), value=-1)
                                      for e in chosen])
        slots = torch.arange(width, device=device)
        self.held = torch.stack([slots[None, :] < e.counts[:, None] for e in chosen])
        self.capacity = torch.as_tensor(np.asarray(capacity), dtype=torch.long, device=device)
        self.policies = list(dict.fromkeys(policies))
        self.group = torch.tensor([self.policies.index(p) for p in policies], dtype=torch.long, device=device)
        self._grouped, self._order = None, None
        self.scores = self.in_order([policy.initial(state, layer_idx, _rows(self.positions, rows),
                                                    _rows(self.held, rows)).float() for policy, rows in self.grouped()])
        self.original_length = state.length
        self.step = 0
        self.scaling = state.scaling
        self.layer = layer
        self.query_window = window = max(policy.query_window for policy in self.policies)
        if window:
            queries = state.signal(WINDOW_QUERIES)[layer_idx][:, -window:]  # as many as were captured
            self.queries = queries[None].expand(len(chosen), -1, -1, -1)
            self.query_positions = torch.arange(state.length - queries.shape[1], state.length, device=device)
        else:
            self.queries, self.query_positions = None, None
        self.write_bias()

    def write_bias(self) -> None:
        """The layer's biases from `held`: 0 where an entry is held, -inf where it left (or is padding)."""
        width = self.layer.prompt_keys.shape[2]
        minus = torch.tensor(float("-inf"), device=self.held.device)
        zero = torch.tensor(0.0, device=self.held.device)
        self.layer.prompt_bias = torch.where(self.held[..., :width], zero, minus)
        self.layer.decoded_bias = torch.where(self.held[..., width:], zero, minus)

    def grouped(self) -> list[tuple[DecodePolicy, torch.Tensor | None]]:
        """(policy, its rows) for every policy still in the batch; rows None when one policy has them all."""
        if self._grouped is None:
            present = torch.unique(self.group).tolist()
            self._grouped = ([(self.policies[present[0]], None)] if len(present) == 1 else
                             [(self.policies[g], (self.group == g).nonzero().flatten()) for g in present])
            self._order = torch.argsort(self.group, stable=True).argsort()  # group-by-group rows -> variant order
        return self._grouped

    def in_order(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-group results (in `grouped`'s order) as one tensor in variant order."""
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts).index_select(0, self._order)

    def select(self, index: torch.Tensor) -> None:
        for name in ("positions", "held", "capacity", "scores", "queries", "group"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, index))
        self._grouped = None

    def recent_attention(self, window: int, held, positions, rows=None) -> torch.Tensor:
        queries = _rows(self.queries, rows)[:, :, -window:].float()  # [V, H_q, w, d]
        query_positions = self.query_positions[-window:]
        window = queries.shape[2]  # fewer than asked while the prompt and the answer so far are shorter
        layer = self.layer
        prompt = layer.prompt_keys if layer.prompt_keys.shape[0] == 1 else _rows(layer.prompt_keys, rows)
        keys = torch.cat([prompt.expand(held.shape[0], -1, -1, -1), _rows(layer.keys, rows)], dim=2).float()
        variants, heads, slots = held.shape
        group = queries.shape[1] // heads
        query_rows = queries.reshape(variants, heads, group * window, -1)
        logits = torch.matmul(query_rows, keys.transpose(-1, -2)) * self.scaling  # [V, H, g*w, S]
        logits = logits.view(variants, heads, group, window, slots)
        visible = held[:, :, None, None, :] & (positions[:, :, None, None, :] <= query_positions[:, None])
        return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)

    def after_step(self, weights: torch.Tensor, query: torch.Tensor) -> None:
        """The new token is in the layer: score, then give up one entry in every head over its capacity.

        `weights` [V, H, group, S]: this step's attention; `query` [V, H_q, 1, d] (post-RoPE)."""
        variants, heads = self.held.shape[:2]
        device = self.held.device
        self.step += 1
        position = self.original_length + self.layer.decoded_length() - 1
        self.held = torch.cat([self.held, torch.ones(variants, heads, 1, dtype=torch.bool, device=device)], -1)
        self.positions = torch.cat([self.positions, torch.full((variants, heads, 1), position, device=device)], -1)
        self.scores = torch.cat([self.scores, torch.zeros(variants, heads, 1, device=device)], -1)
        if self.queries is not None:
            self.queries = torch.cat([self.queries, query], dim=2)[:, :, -self.query_window :]
            self.query_positions = torch.cat([self.query_positions, torch.tensor([position], device=device)])
            self.query_positions = self.query_positions[-self.query_window :]
        weights = weights.float()
        updated, protected = [], []
        for policy, rows in self.grouped():
            view = StepView(self.step, _rows(weights, rows), _rows(self.held, rows), _rows(self.positions, rows),
                            _rows(self.scores, rows), _rows(self.capacity, rows), position + 1, self, rows)
            view.scores = policy.update(view).float()
            updated.append(view.scores)
            protected.append(policy.protected(view))
        self.scores, protected = self.in_order(updated), self.in_order(protected)
        candidates = self.held & ~protected
        candidates = torch.where(candidates.any(-1, keepdim=True), candidates, self.held)
        # Candidates rank below every other slot even when a candidate's score is +inf (not scored yet).
        ranked = torch.where(candidates, self.scores.clamp(max=3e38), torch.tensor(float("inf"), device=device))
        victim = ranked.argmin(-1, keepdim=True)  # ties: the oldest
        over = self.held.sum(-1, keepdim=True) > self.capacity[..., None]
        self.held = self.held.scatter(-1, victim, self.held.gather(-1, victim) & ~over)
        self.write_bias()

    def held_counts(self) -> torch.Tensor:
        """[V, H] entries each head holds now."""
        return self.held.sum(-1)


def held_entries(layer) -> LayerEntries:
    """What variant 0 of an evicting layer holds now, as entries (prompt and decoded, in position order)."""
    evictor = layer.evictor
    held, positions = evictor.held[0], evictor.positions[0]
    keys = torch.cat([layer.prompt_keys[0], layer.keys[0]], dim=1)
    values = torch.cat([layer.prompt_values[0], layer.values[0]], dim=1)
    return gather_slots(keys, values, positions, held)


def gather_slots(keys, values, positions, held) -> LayerEntries:
    """Entries of the held slots [H, S], padded to the head that holds most."""
    counts = held.sum(-1)
    order = torch.argsort((~held).to(torch.int8), dim=-1, stable=True)[..., : int(counts.max())]
    heads = torch.arange(keys.shape[0], device=keys.device)[:, None]
    valid = torch.arange(order.shape[1], device=keys.device)[None, :] < counts[:, None]
    return LayerEntries(keys[heads, order], values[heads, order], positions.gather(1, order).masked_fill(~valid, -1),
                        counts)


def capacities(counts: np.ndarray, budget: int) -> np.ndarray:
    """Entries each (layer, KV head) may hold while decoding: its prompt count, or B when the whole prompt
    fit (n <= B: the head grows to B before it evicts), so every variant's total is exactly L x H_kv x B."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.sum() < counts.size * budget:
        return np.maximum(counts, budget)
    return counts


def peak_entries(counts: np.ndarray, fed: int, capacity: np.ndarray | None = None) -> float:
    """Mean over (layer, KV head) of the most entries a head held after a step: its prompt count plus the
    `fed` decoded tokens, capped at `capacity` under a total budget (None: uncapped, `prompt` mode)."""
    held = np.asarray(counts, dtype=np.int64) + max(0, fed)
    if capacity is not None:
        held = np.minimum(held, capacity)
    return round(float(held.mean()), 3)


def per_variant(policy: DecodePolicy | list[DecodePolicy], count: int) -> list[DecodePolicy]:
    """`policy` for each of `count` variants: one shared by all, or a list already per variant."""
    return list(policy) if isinstance(policy, (list, tuple)) else [policy] * count


def attach(cache, state, variants: list[list[LayerEntries]], policy: DecodePolicy | list[DecodePolicy],
           caps: list[np.ndarray]) -> None:
    """Give every layer of `cache` (built from `variants`) an evictor; `caps[v]` is variant v's [L, H] capacity.
    `policy`: one for every variant, or a list with variant v's policy at v."""
    policies = per_variant(policy, len(variants))
    for layer_idx, layer in enumerate(cache.layers):
        chosen = [variant[layer_idx] for variant in variants]
        layer.evictor = LayerEvictor(policies, state, layer_idx, layer, chosen, [cap[layer_idx] for cap in caps])
