"""Compression methods: the shared machinery (`core/`), the signals several methods read (`signals/`), and one
module or folder per method (`gracekv/`, `lukv/`, `kvzap/`, `snapkv.py`, ...); the named methods are the table
`presets.toml`.

Every module under this package, subpackages included, is imported here (`core.registry.discover`), so a method's
module registers its scorer, allocator, head split, method class and recorders (`register_scorer`,
`register_allocator`, ..., `engine.recorders.register_recorder`) by being there, wherever it sits.
"""

from ripplekv.methods.core.registry import discover

MODULES = discover(__name__, __path__)

from ripplekv.methods.core.base import ALLOCATORS, SCORERS, AllocatorScorer, Method  # noqa: E402
from ripplekv.methods.core.spec import PRESETS, make_method, method_names, parse_spec  # noqa: E402

__all__ = ["ALLOCATORS", "PRESETS", "SCORERS", "AllocatorScorer", "Method", "make_method", "method_names", "parse_spec"]
