"""ripplekv: KV-cache compression benchmarking under exactly matched budgets.

The Python API (`ripplekv.compress`, `generate`, `load_run`, `methods`, ...) lives in `ripplekv.api` and is
imported on first use, so `import ripplekv` (and the CLI's start) stays cheap: no torch until it is needed.
"""
__version__ = "0.1.0"

_API = ("Answer", "CompressedPrompt", "MethodInfo", "Prompt", "Run", "compress", "generate", "load_model",
        "load_run", "method", "list_methods", "sample_prompt")
__all__ = ["Notice", "UserError", "__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from ripplekv import api

        return getattr(api, name)
    if name in ("UserError", "Notice"):
        from ripplekv import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'ripplekv' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
