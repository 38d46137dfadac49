"""The route as an assignment of methods to layers: the `--max-share` caps, the lowest-KL assignment under
them (an exact assignment over method slots), and the random placements a route is ranked against."""

from __future__ import annotations

import numpy as np

from ripplekv.errors import UserError


def parse_caps(items, labels: list[str], num_layers: int) -> dict[str, int]:
    """`--max-share` items (`m=0.5`, or a bare `0.5` for every candidate) -> most layers per method."""
    shares: dict[str, float] = {}
    for item in [part.strip() for text in items for part in str(text).split(",") if part.strip()]:
        name, sep, value = item.rpartition("=")
        try:
            share = float(value)
        except ValueError:
            share = float("nan")
        if not 0 < share <= 1:
            raise UserError(f"--max-share {item!r}: the share must be a number in (0, 1], e.g. snapkv=0.5")
        if not sep:
            shares.update({label: share for label in labels})
        elif name in labels:
            shares[name] = share
        else:
            raise UserError(f"--max-share {item!r}: {name!r} is not a candidate ({', '.join(labels)})")
    caps = {label: int(np.floor(shares.get(label, 1.0) * num_layers + 1e-9)) for label in labels}
    if sum(caps.values()) < num_layers:
        raise UserError(f"--max-share caps allow only {sum(caps.values())} of {num_layers} layers; raise the shares")
    return caps


def choose_route(preferences: np.ndarray, labels: list[str], caps: dict[str, int] | None = None) -> list[str]:
    """Per layer the lowest-KL method; under caps, the assignment with the lowest total KL."""
    from scipy.optimize import linear_sum_assignment

    num_layers = preferences.shape[0]
    caps = caps or {label: num_layers for label in labels}
    slots = [index for index, label in enumerate(labels) for _ in range(min(caps[label], num_layers))]
    rows, cols = linear_sum_assignment(preferences[:, slots])
    route = [""] * num_layers
    for row, col in zip(rows, cols):
        route[row] = labels[slots[col]]
    return route


def random_placements(route: list[str], count: int, seed: int) -> list[list[str]]:
    """`count` random reorderings of the route: the same method counts in random layers."""
    rng = np.random.default_rng(seed)
    return [[route[i] for i in rng.permutation(len(route))] for _ in range(count)]
