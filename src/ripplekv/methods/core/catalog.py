"""The methods a user can choose, as data: what `ripplekv methods` prints and `ripplekv.list_methods()` returns,
and the one place that turns a list of specs into checked methods (eval, the Python API).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ripplekv.engine.config_shape import ConfigShape
from ripplekv.errors import UserError
from ripplekv.methods.core.base import ALLOCATORS, SCORERS, Method
from ripplekv.methods.core.spec import (
    PRESETS,
    check_distinct,
    collapse_aliases,
    component_names,
    defaults_of,
    make_method,
    shared_option_users,
)

REFERENCE = "full"


@dataclass(frozen=True)
class MethodInfo:
    """One named method: its allocator and scorer and their options with defaults (None for `full`), and its family."""

    name: str
    allocator: str | None
    scorer: str | None
    options: dict
    about: str
    family: str  # what it is reported beside (the preset table's family column)
    alias_of: str | None = None  # the canonical spec when this name is another name for it


def catalog() -> list[MethodInfo]:
    """Every named method, sorted by name."""
    rows = []
    for name, chosen in sorted(PRESETS.items()):
        if chosen.is_full:
            rows.append(MethodInfo(name, None, None, {}, chosen.about, chosen.family))
            continue
        parts = [chosen.own.Options] if chosen.own else [ALLOCATORS[chosen.allocator], SCORERS[chosen.scorer]]
        options = {key: value for part in parts for key, value in defaults_of(part).items()}
        rows.append(MethodInfo(name, *component_names(chosen), options, chosen.about, chosen.family, chosen.alias_of))
    return rows


def method_notes() -> dict[str, dict]:
    """preset name -> {about, defaults, alias_of}: what a results page says of each method (analysis may not
    import methods, so the commands hand it this)."""
    return {info.name: {"about": info.about, "defaults": info.options, "alias_of": info.alias_of} for info in catalog()}


def build_methods(specs: Sequence[str], shared: dict, notes: list[str] | None = None) -> dict[str, Method]:
    """label -> Method for `full` and every spec, checked as eval checks them.

    `shared` options (--window, --allocation, ...) apply to the methods that take them; one that applies
    to none is a mistake, and so are two specs with the same label (their lines would mix) and one method
    spelt twice. Another name for a method already given (`uniform` beside `snapkv`) is computed once:
    a line saying so goes to `notes` when given.
    """
    built = [make_method(spec, shared=shared) for spec in dict.fromkeys((REFERENCE, *specs))]
    for key, used in shared_option_users(specs, shared).items():
        if not used:
            raise UserError(f"{{{key}}} applies to none of the chosen methods ({', '.join(specs)})", key)
    methods = {method.label: method for method in built}
    if len(methods) < len(built):
        repeated = sorted({m.label for m in built if sum(other.label == m.label for other in built) > 1})
        raise UserError(f"{{methods}}: two methods share the label {', '.join(repeated)} (one method spelt twice, "
                        "or file options with the same file name); name each method once, and give files different names",
                        "methods")
    check_distinct(built)
    kept, said = collapse_aliases(built)
    if notes is not None:
        notes.extend(said)
    return {method.label: method for method in kept}


def check_fitted(methods, config, bundled: bool) -> None:
    """Every method that reads a fitted file (LU-KV's curve, KVzap's surrogate) has one for this model (from
    its config; `bundled`: the bundled model, whose files are shipped), refused in one line before any prefill:
    a method would otherwise fail after the first prefill, or run without its file at budgets where it is
    never read."""
    counts = ConfigShape.of(config)
    shape = (counts.layers, counts.kv_heads, counts.hidden)
    for method in methods:
        if hasattr(method, "check_fitted"):
            method.check_fitted(shape, bundled)
