"""How far two per-layer choices agree (two routes, or two halves of one route's calibration), against chance.

A route names a method per layer. Two routes chosen on different calibration prompts agree on some layers;
how many would agree by chance alone is what the same two routes give when the layers of one are shuffled
(its method counts kept): sum over methods of count_a(m) x count_b(m) / L. A route that mostly picks one method
agrees with anything that mostly picks it too, so the count means something only beside that baseline.
"""

from __future__ import annotations

from collections import Counter


def route_agreement(first: list[str], second: list[str]) -> dict:
    """Layers on which two per-layer choices name the same method, and the agreement expected by chance."""
    if len(first) != len(second) or not first:
        raise ValueError(f"routes over different layers: {len(first)} and {len(second)}")
    layers = len(first)
    same = sum(a == b for a, b in zip(first, second))
    counts_a, counts_b = Counter(first), Counter(second)
    chance = sum(counts_a[m] * counts_b[m] for m in counts_a) / layers
    return {"agreement": int(same), "layers": layers, "chance": float(chance)}


def agreement_text(result: dict) -> str:
    """`13 of 30 layers (chance 9.4)`."""
    return f"{result['agreement']} of {result['layers']} layers (chance {result['chance']:.1f})"
