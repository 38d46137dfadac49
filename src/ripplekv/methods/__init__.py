"""Compression methods: allocators and scorers (one small file each) and the presets built from them.

Every module of this package (its subpackages' too) is imported here, so a new method's module registers its scorer, allocator and
recorders (`register_scorer`, `register_allocator`, `engine.recorders.register_recorder`) by being there.
"""

import importlib
import pkgutil

for _module in sorted(info.name for info in pkgutil.walk_packages(__path__, f"{__name__}.")):
    importlib.import_module(_module)

from ripplekv.methods.core.base import ALLOCATORS, SCORERS, AllocatorScorer, Method  # noqa: E402
from ripplekv.methods.core.spec import PRESETS, make_method, method_names, parse_spec  # noqa: E402

__all__ = ["ALLOCATORS", "PRESETS", "SCORERS", "AllocatorScorer", "Method", "make_method", "method_names", "parse_spec"]
