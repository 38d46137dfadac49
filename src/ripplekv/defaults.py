"""The methods the commands choose by default, named here so that no command names a method itself.

Torch-free (the CLI shows these in --help without loading the engine); `methods.presets` checks that
each one is a preset.
"""

DEFAULT_EVAL_METHODS = ("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")  # `eval --methods`
DEFAULT_ROUTE_CANDIDATES = ("snapkv", "streamingllm", "h2o", "tova", "knorm")  # `route --methods`
UNIFORM_BASELINES = ("uniform", "snapkv")  # what a report compares each method with, first one present
ALLOCATION_METHOD = "ripplekv"  # `allocate`: the method that turns multipliers into layer budgets
ALLOCATION_PLOT_BESIDE = "pyramidkv"  # `allocate`'s plot draws its layer budgets beside this method's
EVICTION_METHOD = "h2o"  # `profile --signal evict --evict-method`: DepthKV prunes with its own H2O-like pruner
CEILINGS = ("oracle",)  # bounds, not methods: reported beside the methods, never ranked
