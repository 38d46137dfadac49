"""A quantizer composed with a method: budget B is memory, spent on more entries at fewer bits.

`snapkv:quant=kivi:bits=4` keeps SnapKV's entries at 4 bits, as many as the bytes of budget B allow;
`kivi:bits=4` keeps every entry at 4 bits when that fits in B's bytes and is *infeasible* otherwise (never
silently over budget). Budget B means the bytes of `min(L x B, sum of capacities)` full-precision (the
model's dtype) K and V entries per KV head (`budget_bytes`); a variant's bytes (`engine.quantize.head_bytes`
summed over layers and KV heads) never exceed them.

How many entries: the largest per-head entry budget B' whose counts (the wrapped method's own allocation at
B') fit in B's bytes, found by bisection (counts grow with B'). So a quantized variant is within one step of
B' of its budget: less than two full-precision entries per (layer, KV head) under it (one more entry per head
costs at most one quantized key and value plus one new key group's minimums and scales). Eviction alone is
exact: `L x H_kv x B` entries at full precision.

Per-layer bits (`bits=profile`, `methods.core.bit_allocation`): the greedy picks each layer's bits first (from B's
bytes when every entry is kept, from `avgbits` when the method also evicts), then the same bisection finds B'
under those bits; bytes are counted layer by layer at each layer's bits (`kept_bytes`), within the same rounding.

Key channels (`think=`, `methods.core.key_channels`) are a third way to spend the bytes: `channels` prunes each
head's keys to fewer channels, and the storage specs count only those (`QuantSpec.key_channels`), so the same
bisection finds how many entries they buy; `snapkv:think=0.5` alone is stored at full precision otherwise.

The entries attention reads are dequantized (`engine.quantize`): memory is accounted, not saved, here.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ripplekv.engine import entries as kv_entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.engine.quantize import QuantSpec, head_bytes, quantize_head
from ripplekv.errors import UserError
from ripplekv.methods.core.bit_allocation import BitProfile
from ripplekv.methods.core.key_channels import KeyChannels


def element_bytes(state: PrefillState) -> int:
    return int(state.keys[0].element_size())


def head_dim(state: PrefillState) -> int:
    return int(state.keys[0].shape[-1])


def budget_bytes(state: PrefillState, budget: int) -> int:
    """The memory budget B stands for on this prompt: `min(L x B, sum of capacities)` full-precision K and V
    entries in each KV head (the entries eviction alone keeps)."""
    entries = min(state.num_layers * budget, sum(state.capacities))
    return state.num_kv_heads * head_bytes(entries, head_dim(state), element_bytes(state), None)


def kept_bytes(state: PrefillState, counts: np.ndarray, spec: QuantSpec | Sequence[QuantSpec] | None = None) -> int:
    """Bytes of a variant keeping `counts` [L, H_kv] entries, stored by `spec` (None: full precision; a sequence:
    one spec per layer)."""
    d, size = head_dim(state), element_bytes(state)
    rows = np.asarray(counts)
    specs = spec if isinstance(spec, Sequence) else [spec] * len(rows)
    return int(sum(head_bytes(int(c), d, size, specs[layer]) for layer, row in enumerate(rows) for c in row))


def stored_as(method, state: PrefillState, budget: int | None) -> Sequence[QuantSpec] | None:
    """How a method stores its entries at `budget` on this prompt: one spec per layer, or None (full precision)."""
    layer_specs = getattr(method, "layer_specs", None)
    return None if layer_specs is None or budget is None else layer_specs(state, budget)


@dataclass(frozen=True)
class Quantized:
    """`inner`'s selection at the entry budget B's bytes afford, stored by `spec` (see the module's docstring)."""

    label: str
    preset: str
    inner: object  # a Method
    quantizer: QuantSpec  # under `profile`, the scheme (axis, group, residual); the bits are per layer
    profile: BitProfile | None = None
    channels: KeyChannels | None = None  # key channels pruned (ThinK); the quantizer may then be full precision
    _plans: dict = field(default_factory=dict, compare=False, repr=False)  # (B, what) -> specs or B', one prefill

    @property
    def name(self) -> str:
        return self.label

    @property
    def is_full(self) -> bool:
        return False

    @property
    def prompt_dependent(self) -> bool:
        """How many entries fit depends on the prompt's length and the model's head size and dtype."""
        return True

    @property
    def knows_answer(self) -> bool:
        return bool(self.inner.knows_answer)

    def check_fitted(self, shape, bundled: bool) -> None:
        if hasattr(self.inner, "check_fitted"):
            self.inner.check_fitted(shape, bundled)

    @property
    def evicts(self) -> bool:
        return not self.inner.is_full

    def describe(self) -> dict:
        inner = {key: value for key, value in self.inner.describe().items() if key != "preset"}
        quantizer = self.quantizer.describe()
        if self.profile is not None:
            quantizer = {**{k: v for k, v in quantizer.items() if k != "bits"}, **self.profile.describe()}
        stored = {} if self.quantizer.is_full_precision else {"quantizer": quantizer}
        if self.channels is not None:
            stored["key_channels"] = self.channels.describe()
        return {"preset": self.preset, **inner, **stored}

    def requirements(self) -> Requirements:
        own = self.channels.requirements() if self.channels is not None else Requirements()
        return self.inner.requirements().union(own)

    def degenerate(self, budget: int) -> str | None:
        """At B <= residual, a method giving every layer and head B entries keeps them all in the full-precision
        residual (one quantized entry more would cost more than B's bytes): it is the method without quantization."""
        allocator = getattr(self.inner, "allocator", None)
        uniform = allocator is not None and allocator.same_budget_every_layer and not allocator.splits_heads
        if self.evicts and uniform and self.channels is None and budget <= self.quantizer.residual:
            return (f"every kept entry is in the {self.quantizer.residual}-entry full-precision residual: this is "
                    f"{self.inner.label} unquantized (raise the budget or lower residual=)")
        return self.inner.degenerate(budget)

    def layer_budgets(self, num_layers: int, budget: int, length) -> list[int]:
        raise UserError(f"{self.label} keeps as many entries as budget {budget}'s bytes allow on each prompt; "
                        "its per-layer counts are recorded per sample by `ripplekv eval`")

    def _fits(self, state: PrefillState, counts: np.ndarray, budget: int, specs) -> bool:
        return kept_bytes(state, counts, specs) <= budget_bytes(state, budget)

    def _cached(self, state: PrefillState, budget: int, what: str, compute):
        """`compute()` once per prefill and budget (`budgets`, `compress` and the line's bytes ask for the same);
        the prefill is held by a weak reference, so a later prefill at the same address is never mistaken for it."""
        owner = self._plans.get("state")
        if owner is None or owner() is not state:
            self._plans.clear()  # one prefill at a time
            self._plans["state"] = weakref.ref(state)
        key = (budget, what)
        if key not in self._plans:
            self._plans[key] = compute()
        return self._plans[key]

    def _layer_specs(self, state: PrefillState, budget: int) -> tuple[QuantSpec, ...] | None:
        """Each layer's storage: the one spec, or the profile's bits (None: not even 2 bits everywhere fits)."""
        quantizer = self.quantizer
        if self.channels is not None:
            quantizer = quantizer.with_key_channels(self._key_channels(state))
        if self.profile is None:
            return (quantizer,) * state.num_layers
        if self.evicts:
            return tuple(quantizer.at(bits) for bits in self.profile.bits_for_average(state.num_layers))
        self.profile.check_layers(state.num_layers)
        counts = self.inner.budgets(state, 1)  # every entry

        def layer_bytes(layer: int, bits: int) -> int:
            return kept_bytes(state, counts[layer:layer + 1], quantizer.at(bits))

        chosen = self.profile.bits_for_bytes(layer_bytes, budget_bytes(state, budget))
        return None if chosen is None else tuple(quantizer.at(bits) for bits in chosen)

    def _key_channels(self, state: PrefillState) -> int | None:
        return None if self.channels is None else self.channels.kept(head_dim(state))

    def layer_specs(self, state: PrefillState, budget: int) -> tuple[QuantSpec, ...] | None:
        """How each layer stores its entries on this prompt at budget B (None: infeasible)."""
        return self._cached(state, budget, "specs", lambda: self._layer_specs(state, budget))

    def entry_budget(self, state: PrefillState, budget: int) -> int | None:
        """The largest B' whose counts fit in budget B's bytes (None: none does, or, without eviction, all
        entries do not)."""
        specs = self.layer_specs(state, budget)
        return None if specs is None else self._cached(state, budget, "entries", lambda: self._search(state, budget, specs))

    def _search(self, state: PrefillState, budget: int, specs) -> int | None:
        if not self.evicts:
            return max(state.capacities) if self._fits(state, self.inner.budgets(state, 1), budget, specs) else None
        low, high = 0, max(state.capacities)  # low fits (0: nothing yet), high + 1 is the first that does not
        if self._fits(state, self.inner.budgets(state, high), budget, specs):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if self._fits(state, self.inner.budgets(state, middle), budget, specs):
                low = middle
            else:
                high = middle
        return low or None

    def infeasible(self, state: PrefillState, budget: int) -> str | None:
        """Why this variant cannot run within budget B's bytes on this prompt (None: it can)."""
        if self.entry_budget(state, budget) is not None:
            return None
        specs = self.layer_specs(state, budget)
        if specs is None:  # the profile's fewest bits
            fewest = self.quantizer.at(2).with_key_channels(self._key_channels(state))
            specs, how = (fewest,) * state.num_layers, "2 bits in every layer (bits=profile's fewest)"
        else:
            how = self.quantizer.bits_text() if self.profile is None else "the profile's bits"
            if self.channels is not None:
                kept = f"{specs[0].key_channels} of {head_dim(state)} key channels"
                how = kept if self.quantizer.is_full_precision else f"{how} and {kept}"
        needed = kept_bytes(state, self.inner.budgets(state, 1), specs)
        what = "every entry" if not self.evicts else "the fewest entries it keeps"
        return f"{what} at {how} takes {needed} bytes, over budget {budget}'s {budget_bytes(state, budget)}"

    def budgets(self, state: PrefillState, budget: int) -> np.ndarray:
        """The `[L, H_kv]` entry counts: the wrapped method's at B' (all of them without eviction). An infeasible
        variant is refused here: the pipeline asks `infeasible` first."""
        chosen = self.entry_budget(state, budget)
        if chosen is None:
            raise UserError(f"{self.label} at budget {budget}: {self.infeasible(state, budget)}")
        return self.inner.budgets(state, chosen)

    def compress(self, state: PrefillState, budget: int) -> list[kv_entries.LayerEntries]:
        """The wrapped method's entries at B', every head's quantize-dequantized (its last `residual` untouched)."""
        self.budgets(state, budget)
        built = self.inner.compress(state, self.entry_budget(state, budget))
        specs = self.layer_specs(state, budget)
        if self.channels is None:
            return [quantize_layer(layer, spec) for layer, spec in zip(built, specs)]
        return [store_layer(entries, self.channels.choose(state, layer, entries), spec)
                for layer, (entries, spec) in enumerate(zip(built, specs))]


def quantize_layer(layer: kv_entries.LayerEntries, spec: QuantSpec) -> kv_entries.LayerEntries:
    """A layer's entries with each head's real entries (in prompt order) quantize-dequantized; new tensors, so a
    layer sharing the prefill's keys and values leaves them intact."""
    counts = [int(c) for c in layer.counts.tolist()]
    in_order = bool((layer.positions[:, 1:] > layer.positions[:, :-1]).all())
    if len(set(counts)) == 1 and counts[0] == layer.capacity and in_order:  # every head alike: all at once
        keys, values = quantize_head(layer.keys, layer.values, spec)
        return kv_entries.LayerEntries(keys, values, layer.positions, layer.counts, layer.log_weights, layer.spans)
    keys, values = layer.keys.clone(), layer.values.clone()
    for head, count in enumerate(int(c) for c in layer.counts.tolist()):
        order = layer.positions[head, :count].argsort(stable=True)  # the residual is the most recent entries
        k, v = quantize_head(layer.keys[head, :count][order], layer.values[head, :count][order], spec)
        keys[head, order] = k
        values[head, order] = v
    return kv_entries.LayerEntries(keys, values, layer.positions, layer.counts, layer.log_weights, layer.spans)


def store_layer(built: kv_entries.LayerEntries, channels: torch.Tensor, spec: QuantSpec) -> kv_entries.LayerEntries:
    """A layer's entries with only `channels` [H_kv, c] of each key stored (the rest zero), those and the values
    quantize-dequantized by `spec` (the kept channels alone form its groups); new tensors, the prefill's untouched."""
    index = channels[:, None, :].expand(-1, built.capacity, -1)
    compact = kv_entries.LayerEntries(built.keys.gather(-1, index), built.values, built.positions, built.counts,
                                      built.log_weights, built.spans)
    if not spec.is_full_precision:
        compact = quantize_layer(compact, spec)
    keys = torch.zeros_like(built.keys).scatter(-1, index, compact.keys)
    return kv_entries.LayerEntries(keys, compact.values, built.positions, built.counts, built.log_weights, built.spans)
