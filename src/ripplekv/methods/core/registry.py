"""Where methods file themselves by name: scorers, allocators, head splits, and method classes (a method of its
own, or an allocator x scorer that checks more when built), the names the preset table (`methods/presets.toml`)
refers to.

`ripplekv.methods` imports every module under it (`discover`), subpackages included, so a method registers by
being there, wherever it sits. A second, different entry under a name already taken is refused: otherwise the
module imported last would silently win. The same class defined again (a module reloaded) is not a conflict.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable

SCORERS: dict[str, type] = {}
ALLOCATORS: dict[str, type] = {}
# Head splits: (state, per-layer budgets, scorer, alpha) -> [L, H_kv] counts, each layer's row summing to
# H_kv x its budget. "even" (every head alike) is the default (`core.base`); `methods.adakv` registers "adakv".
HEAD_SPLITS: dict[str, Callable] = {}
DEFAULT_HEAD_ALPHA: dict[str, float] = {}  # each head split's safeguard when `head_alpha` is not given
METHOD_CLASSES: dict[str, type] = {}  # the preset table's `class` column


def _origin(entry) -> tuple[str, str]:
    return entry.__module__, entry.__qualname__


def file_under(registry: dict, what: str, name: str, entry):
    """File `entry` under `name`, refusing a different one already there (a ValueError naming both)."""
    known = registry.get(name)
    if known is not None and _origin(known) != _origin(entry):
        raise ValueError(f"{what} {name!r} is already registered ({'.'.join(_origin(known))}); "
                         f"{'.'.join(_origin(entry))} must take another name")
    registry[name] = entry
    return entry


def _class_registrar(registry: dict, what: str):
    """A class decorator factory: `@register(name)` files the class in `registry` and names it."""

    def register(name: str):
        def wrap(cls):
            file_under(registry, what, name, cls)
            cls.name = name
            return cls

        return wrap

    return register


register_scorer = _class_registrar(SCORERS, "scorer")
register_allocator = _class_registrar(ALLOCATORS, "allocator")


def register_method_class(name: str):
    """File a method class for the preset table's `class` column (its `name` is left as the class defines it)."""
    return lambda cls: file_under(METHOD_CLASSES, "method class", name, cls)


def register_head_split(name: str, default_alpha: float | None = None):
    """File a head split (`split=NAME`), with its safeguard when a spec gives no `head_alpha`."""

    def wrap(split: Callable) -> Callable:
        file_under(HEAD_SPLITS, "head split", name, split)
        if default_alpha is not None:
            DEFAULT_HEAD_ALPHA[name] = default_alpha
        return split

    return wrap


def discover(package: str, path: Iterable[str]) -> list[str]:
    """Import every module under a package (subpackages included), in name order; each registers what it
    defines. Returns the module names."""
    names = sorted(info.name for info in pkgutil.walk_packages(path, f"{package}."))
    for name in names:
        importlib.import_module(name)
    return names
