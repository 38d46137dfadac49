"""ripplekv: KV-cache compression benchmarking under exactly matched budgets."""
__version__ = "0.1.0"
