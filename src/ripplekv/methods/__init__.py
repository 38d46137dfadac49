"""Compression methods: allocators and scorers (one small file each) and the presets built from them.

Every module of this package is imported here, so a new method's module registers its scorer, allocator and
recorders (`register_scorer`, `register_allocator`, `engine.recorders.register_recorder`) by being there.
"""

import importlib
import pkgutil

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

from ripplekv.methods.base import ALLOCATORS, SCORERS, AllocatorScorer, Method  # noqa: E402
from ripplekv.methods.presets import PRESETS, make_method, method_names, parse_spec  # noqa: E402

__all__ = ["ALLOCATORS", "PRESETS", "SCORERS", "AllocatorScorer", "Method", "make_method", "method_names", "parse_spec"]
