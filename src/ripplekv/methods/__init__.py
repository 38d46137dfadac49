"""Compression methods, one file each; importing this package fills the registry."""

from ripplekv.methods import full, pyramidkv, random_keep, ripplekv, snapkv, streamingllm  # noqa: F401
from ripplekv.methods.base import REGISTRY, Method, make_method, method_names

__all__ = ["REGISTRY", "Method", "make_method", "method_names"]
