"""Layer-wise routing: each layer ranks its entries with the scorer of the method named for it.

The route CSV has columns `layer,method` (one row per layer, 0..L-1); a method is any spec with a scorer
(`snapkv`, `streamingllm`, `snapkv:kernel=5`, ...). Only the named method's scorer is used: budgets come
from the routed method's own allocator (uniform, or `routed:allocator=file` with --allocation), so a
route and an allocation combine into one method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import FILE, AllocatorScorer, Scorer, register_scorer
from ripplekv.methods.core.tables import check_layer_count, read_layer_table


def read_route(path: str | Path) -> list[tuple[int, str]]:
    """(line number, method spec) by layer from a route CSV (`tables.read_layer_table`)."""
    rows = read_layer_table(path, "method", "route", "write layer,method rows (or run `ripplekv route`)")
    for number, spec in rows:
        if not spec:
            raise UserError(f"route file {path} line {number} has a layer without a method")
    return rows


def routed_scorer(spec: str, method) -> Scorer:
    """The scorer a route uses for `method` (spec `spec`), or a UserError when a route cannot use it as it is:
    a route keeps a method's scorer alone, at the routed method's budgets, so a method that is more than its
    scorer (budgets spread over layers, a head split, budgets from the answer) would silently run as another.
    Shared by route files and `ripplekv route`'s candidates."""
    if not isinstance(method, AllocatorScorer) or method.is_full or not method.scorer.routable:
        raise UserError(f"{spec!r} cannot be routed to (a route names methods with a scorer, e.g. snapkv)")
    allocator, scorer = method.allocator, method.scorer
    if allocator.knows_answer or not allocator.same_budget_every_layer or allocator.splits_by_scores:
        what = "budgets from the full cache's answer (a ceiling)" if allocator.knows_answer else (
            "a head split" if allocator.same_budget_every_layer else "budgets spread over layers")
        plain = uniform_spec(scorer.name)
        raise UserError(f"{spec!r} is allocator {allocator.name} ({what}) x scorer {scorer.name}; a route keeps only "
                        f"a method's scorer, so it would run as {plain}: name a method with uniform budgets and no "
                        f"head split (e.g. {plain})")
    return scorer


def uniform_spec(scorer: str) -> str:
    """A spec of `scorer` at uniform budgets with no head split (what a route or a pruner runs of a method)."""
    return "snapkv" if scorer == "snapkv" else f"snapkv:scorer={scorer}"


def scorer_identity(scorer: Scorer) -> str:
    """What a scorer selects, whatever method names it (`snapkv` and `uniform` route to one scorer)."""
    import json

    from ripplekv.methods.core.base import options_of

    return json.dumps({"name": scorer.name, **options_of(scorer)}, sort_keys=True, default=str)


@register_scorer("router")
@dataclass(frozen=True)
class Router(Scorer):
    route: str | None = field(default=None, metadata=FILE)
    scorers: tuple = field(default=(), repr=False, metadata={"internal": True})
    methods: tuple[str, ...] = field(default=(), metadata={"internal": True, "record": True})

    def __post_init__(self):
        from ripplekv.methods.core.spec import make_method

        if self.route is None:
            raise UserError("routed needs a route: pass a CSV of layer,method rows as {route}", "route")
        rows = read_route(self.route)
        specs, scorers = [spec for _, spec in rows], []
        for number, spec in rows:
            try:
                scorers.append(routed_scorer(spec, make_method(spec)))
            except UserError as err:
                raise UserError(f"route file {self.route} line {number}: {err}") from None
        object.__setattr__(self, "scorers", tuple(scorers))
        object.__setattr__(self, "methods", tuple(specs))

    def degenerate(self, budget: int) -> str | None:
        found = [(spec, s.degenerate(budget)) for spec, s in zip(self.methods, self.scorers)]
        found = [(spec, why) for spec, why in found if why]
        return f"its layers routed to {found[0][0]}: {found[0][1]}" if found else None

    def check_layers(self, num_layers: int) -> None:
        check_layer_count(len(self.scorers), num_layers, f"route {self.route}", "route with the same model")

    def _scorer(self, state, layer) -> Scorer:
        self.check_layers(state.num_layers)
        return self.scorers[layer]

    routable = False  # a route names scorers; a router cannot be one of them

    @property
    def knows_answer(self) -> bool:  # a route with one answer-aware layer makes a ceiling
        return any(s.knows_answer for s in self.scorers)

    def requirements(self) -> Requirements:
        return Requirements.of_all(self.scorers)

    def floor(self) -> int:
        return max(s.floor() for s in self.scorers)

    def scores(self, state, layer):
        return self._scorer(state, layer).scores(state, layer)

    def keep(self, state, layer, counts):
        return self._scorer(state, layer).keep(state, layer, counts)
