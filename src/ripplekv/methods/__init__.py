"""Compression methods: allocators and scorers (one small file each) and the presets built from them."""

from ripplekv.methods import (  # noqa: F401  (registration)
    adakv,
    allocation_ceiling,
    allocators,
    cake,
    compresskv,
    criticalkv,
    defensivekv,
    dynamickv,
    expected_attention,
    global_budget,
    gracekv,
    h2o,
    keydiff,
    knorm,
    kvzap,
    kvzip,
    lava,
    lukv,
    oracle,
    pyramidinfer,
    random_keep,
    router,
    snapkv,
    squeezeattention,
    streamingllm,
    tova,
)
from ripplekv.methods.base import ALLOCATORS, SCORERS, AllocatorScorer, Method
from ripplekv.methods.presets import PRESETS, make_method, method_names, parse_spec

__all__ = ["ALLOCATORS", "PRESETS", "SCORERS", "AllocatorScorer", "Method", "make_method", "method_names", "parse_spec"]
