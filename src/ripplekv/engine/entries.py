"""What a compressed layer holds: per KV head, a set of entries (not a mask over the prompt).

An entry has a key, a value, an additive log-weight and the prompt position it comes from. A plain token
has log-weight 0; a prototype that stands for m tokens has log m (attention to it counts m times), and
its position is a representative one. Heads may hold different numbers of entries: each head's list is
padded to the layer's longest with log-weight -inf, which attention turns into exactly zero weight.

Keeping a subset of tokens is one way to build entries (`gather`); merging methods build prototypes.
The cache and the attention consume entries only, so a new method never touches `cache.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerEntries:
    """One layer's entries for one variant, padded across heads."""

    keys: torch.Tensor  # [H_kv, K, d]
    values: torch.Tensor  # [H_kv, K, d]
    positions: torch.Tensor  # [H_kv, K] long; source prompt position, -1 on padding
    counts: torch.Tensor  # [H_kv] long; real entries per head (a prototype counts as one)
    log_weights: torch.Tensor | None = None  # [H_kv, K] float32; None when every entry is a plain token
    spans: torch.Tensor | None = None  # [H_kv, K, 2] prompt span [start, end) a prototype stands for; None: tokens

    @property
    def num_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    def bias(self) -> torch.Tensor | None:
        """The additive attention bias [H_kv, K] in float32: log-weights, -inf on padding (None: all zero)."""
        padded = not bool((self.counts == self.capacity).all())
        if self.log_weights is None and not padded:
            return None
        bias = (
            self.log_weights.float()
            if self.log_weights is not None
            else torch.zeros(self.keys.shape[:2], dtype=torch.float32, device=self.keys.device)
        )
        if padded:
            valid = torch.arange(self.capacity, device=self.keys.device)[None, :] < self.counts[:, None]
            bias = bias.masked_fill(~valid, float("-inf"))
        return bias

    def total(self) -> int:
        return int(self.counts.sum())


def full(keys: torch.Tensor, values: torch.Tensor, start: int = 0) -> LayerEntries:
    """Every token of a layer from prompt position `start` on (a sliding-window layer holds only its last
    tokens), sharing the prefill's tensors (a view, no copy)."""
    heads, length = keys.shape[0], keys.shape[1]
    positions = torch.arange(start, length, device=keys.device).expand(heads, length - start)
    counts = torch.full((heads,), length - start, dtype=torch.long, device=keys.device)
    return LayerEntries(keys[:, start:], values[:, start:], positions, counts)


def gather(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> LayerEntries:
    """The tokens a bool mask [H_kv, n] keeps, in prompt order, padded to the head that keeps most."""
    counts = mask.sum(-1)
    longest = int(counts.max())
    # A stable sort puts kept positions first, in ascending order.
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :longest]
    heads = torch.arange(keys.shape[0], device=keys.device)[:, None]
    valid = torch.arange(longest, device=keys.device)[None, :] < counts[:, None]
    positions = order.masked_fill(~valid, -1)
    return LayerEntries(keys[heads, order], values[heads, order], positions, counts)


def pad_variants(layers: list[LayerEntries]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stack one layer of V variants: keys/values [V, H, K, d] and bias [V, H, K] (None when all zero)."""
    longest = max(entry.capacity for entry in layers)
    biases = [entry.bias() for entry in layers]
    if all(entry.capacity == longest for entry in layers) and all(b is None for b in biases):
        return torch.stack([e.keys for e in layers]), torch.stack([e.values for e in layers]), None
    keys, values, bias = [], [], []
    for entry, entry_bias in zip(layers, biases):
        extra = longest - entry.capacity
        device = entry.keys.device
        if entry_bias is None:
            entry_bias = torch.zeros(entry.num_heads, entry.capacity, dtype=torch.float32, device=device)
        keys.append(torch.nn.functional.pad(entry.keys, (0, 0, 0, extra)))
        values.append(torch.nn.functional.pad(entry.values, (0, 0, 0, extra)))
        bias.append(torch.nn.functional.pad(entry_bias, (0, extra), value=float("-inf")))
    return torch.stack(keys), torch.stack(values), torch.stack(bias)
