"""Layer-wise routing: each layer ranks its entries with the scorer of the method named for it.

The route CSV has columns `layer,method` (one row per layer, 0..L-1); a method is any spec with a scorer
(`snapkv`, `streamingllm`, `snapkv:kernel=5`, ...). Only the named method's scorer is used: budgets come
from the routed method's own allocator (uniform, or `routed:allocator=file` with --allocation), so a
route and an allocation combine into one method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.base import AllocatorScorer, Scorer, register_scorer


def read_route(path: str | Path) -> list[str]:
    """Method specs by layer from a route CSV (one clear error for a missing or malformed file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"route file {path} does not exist; write layer,method rows (or run `ripplekv route`)")
    try:
        table = pd.read_csv(path, dtype={"method": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise UserError(f"route file {path} is not a readable CSV ({err.__class__.__name__})") from None
    if not {"layer", "method"} <= set(table.columns):
        raise UserError(f"route file {path} needs columns layer,method")
    layers = pd.to_numeric(table["layer"], errors="coerce")
    if layers.isna().any() or sorted(layers.astype(int).tolist()) != list(range(len(table))):
        raise UserError(f"route file {path} must list layers 0..{len(table) - 1} exactly once each")
    if table["method"].isna().any():
        raise UserError(f"route file {path} has a layer without a method")
    return [str(m).strip() for m in table["method"].to_numpy()[layers.astype(int).to_numpy().argsort()]]


@register_scorer("router")
@dataclass(frozen=True)
class Router(Scorer):
    route: str | None = None
    scorers: tuple = field(default=(), repr=False, metadata={"internal": True})
    methods: tuple[str, ...] = field(default=(), metadata={"internal": True, "record": True})

    def __post_init__(self):
        from ripplekv.methods.presets import make_method

        if self.route is None:
            raise UserError("routed needs a route: pass --route ROUTE.csv (layer,method rows)")
        specs = read_route(self.route)
        scorers = []
        for spec in specs:
            method = make_method(spec)
            if not isinstance(method, AllocatorScorer) or method.is_full or not method.scorer.routable:
                raise UserError(f"route file {self.route}: {spec!r} cannot be routed to (it needs a scorer)")
            scorers.append(method.scorer)
        object.__setattr__(self, "scorers", tuple(scorers))
        object.__setattr__(self, "methods", tuple(specs))

    def _scorer(self, state, layer) -> Scorer:
        if len(self.scorers) != state.num_layers:
            raise UserError(f"route {self.route} has {len(self.scorers)} layers but the model has {state.num_layers}")
        return self.scorers[layer]

    routable = False  # a route names scorers; a router cannot be one of them

    def requirements(self) -> Requirements:
        return Requirements.of_all(self.scorers)

    def floor(self) -> int:
        return max(s.floor() for s in self.scorers)

    def scores(self, state, layer):
        return self._scorer(state, layer).scores(state, layer)

    def keep(self, state, layer, counts):
        return self._scorer(state, layer).keep(state, layer, counts)
