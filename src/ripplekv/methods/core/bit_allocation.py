"""Bits per layer from RippleKV's sensitivity profile (`bits=profile`): an allocator over bits.

The profile (`ripplekv profile`, the `sensitivity` column of the allocation file `ripplekv allocate` writes)
measures, per layer l, the KL to the full cache when that layer's values get noise of relative size eta. For
small perturbations the KL is quadratic in the perturbation, so KL_l(error) ~ s_l x (error / eta)^2; a b-bit
quantizer's error scales as 2^-b (one level is the range over 2^b - 1), so the predicted loss of layer l at b
bits is s_l x 4^-b (constants common to every layer drop out of a comparison between layers).

The rule: every layer starts at 2 bits, keys and values alike (the profile perturbs values only, so it says
nothing about a key/value split and the rule does not invent one); then, repeatedly, among the upgrades
2 -> 4 -> 8 -> 16 that still fit the allowance, the one with the largest predicted-loss drop
s_l x (4^-b - 4^-b') per extra unit is made (ties: the lower layer), until none fits. A layer's drop
shrinks 15-fold or more per step while its cost doubles, so the drop per unit falls step by step (a concave
gain) and this greedy exchange is the usual knapsack greedy for it;
a layer with sensitivity 0 (or below: a noisy estimate) gains nothing and is upgraded only with what is left.

The allowance is in bytes for quantization alone (`kivi:bits=profile`: every entry kept, the greedy spends
budget B's bytes; infeasible when even 2 bits everywhere does not fit) and in bits for a method that also
evicts (`snapkv:quant=kivi:bits=profile`): `avgbits` (default 4) bits per quantized number on average over
the layers, each layer weighted equally, so the bits do not depend on how many entries are kept; then the
entry bisection of `methods.core.quantized` keeps the most entries whose bytes under those bits fit B. A joint
search over entries and bits per layer would need a model of how eviction's loss and quantization's add;
fixing the average bits keeps the choice well defined and leaves avgbits as the one stated knob.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ripplekv.engine.quantize import BITS
from ripplekv.methods.core.tables import check_layer_count, read_numbers

START_BITS = BITS[0]
UPGRADE = dict(zip(BITS, BITS[1:]))  # 2 -> 4 -> 8 -> 16
DEFAULT_AVERAGE_BITS = 4.0


def read_sensitivity(path: str) -> tuple[float, ...]:
    """The profile's per-layer sensitivity from an allocation file (its `sensitivity` column)."""
    return tuple(read_numbers(path, "sensitivity", "allocation", "run `ripplekv profile` then `ripplekv allocate`"))


def predicted_loss(sensitivity: float, bits: int) -> float:
    """s_l x 4^-b (see the module's docstring); a negative estimate counts as 0."""
    return max(sensitivity, 0.0) * 4.0 ** -bits


def greedy_bits(sensitivity, cost: Callable[[int, int], float], allowance: float) -> list[int] | None:
    """Bits per layer: all at 2, then the upgrade with the largest predicted-loss drop per extra `cost` that
    keeps the total within `allowance`, until none does. None: 2 bits everywhere already exceeds it."""
    table = [{bits: cost(layer, bits) for bits in BITS} for layer in range(len(sensitivity))]
    chosen = [START_BITS] * len(sensitivity)
    spent = sum(row[START_BITS] for row in table)
    if spent > allowance:
        return None
    while True:
        best = None  # (drop per unit, layer, extra)
        for layer, bits in enumerate(chosen):
            if bits not in UPGRADE:
                continue
            extra = table[layer][UPGRADE[bits]] - table[layer][bits]
            if spent + extra > allowance:
                continue
            drop = predicted_loss(sensitivity[layer], bits) - predicted_loss(sensitivity[layer], UPGRADE[bits])
            rate = drop / extra if extra > 0 else float("inf")
            if best is None or rate > best[0]:
                best = (rate, layer, extra)
        if best is None:
            return chosen
        _, layer, extra = best
        chosen[layer] = UPGRADE[chosen[layer]]
        spent += extra


@dataclass(frozen=True)
class BitProfile:
    """Per-layer bits from a sensitivity profile; `average_bits` None: spend bytes (quantization alone)."""

    allocation: str
    sensitivity: tuple[float, ...]
    average_bits: float | None = None

    def check_layers(self, num_layers: int) -> None:
        check_layer_count(len(self.sensitivity), num_layers, "allocation", "profile and allocate with the same model")

    def bits_for_average(self, num_layers: int) -> list[int]:
        """Bits per layer with `average_bits` per number on average, each layer weighted equally."""
        self.check_layers(num_layers)
        return greedy_bits(self.sensitivity, lambda layer, bits: bits, self.average_bits * num_layers)

    def bits_for_bytes(self, layer_bytes: Callable[[int, int], int], allowance: int) -> list[int] | None:
        """Bits per layer whose bytes (`layer_bytes(layer, bits)`) fit `allowance`; None: not even at 2 bits."""
        return greedy_bits(self.sensitivity, layer_bytes, allowance)

    def describe(self) -> dict:
        described = {"bits": "profile", "allocation": self.allocation, "sensitivity": list(self.sensitivity)}
        if self.average_bits is not None:
            described["avgbits"] = self.average_bits
        return described
