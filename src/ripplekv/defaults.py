"""The methods the commands choose by default, named here so that no command names a method itself, and
the fixed choices and shared defaults of the commands' options.

Torch-free (the CLI shows these in --help without loading the engine); `methods.presets` checks that
each method named here is a preset.
"""

DEFAULT_EVAL_METHODS = ("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")  # `eval --methods`
DEFAULT_ROUTE_CANDIDATES = ("snapkv", "streamingllm", "h2o", "tova", "knorm")  # `route --methods`
UNIFORM_BASELINES = ("uniform", "snapkv")  # what a report compares each method with, first one present
ALLOCATION_METHOD = "ripplekv"  # `allocate`: the method that turns multipliers into layer budgets
ALLOCATION_PLOT_BESIDE = "pyramidkv"  # `allocate`'s plot draws its layer budgets beside this method's
EVICTION_METHOD = "h2o"  # `profile --signal evict --evict-method`: DepthKV prunes with its own H2O-like pruner
CEILINGS = ("oracle", "allocation-ceiling")  # bounds, not methods: reported beside the methods, never ranked
# The families the report's forest plots colour methods by (a composition takes its preset's family); every
# preset belongs to one (tests/test_methods.py checks), anything else is drawn as "other".
METHOD_FAMILIES = {
    "uniform baselines": ("uniform", "snapkv", "streamingllm", "random", "h2o", "tova", "knorm"),
    "RippleKV": ("ripplekv", "routed-ripplekv"),
    "seed systems": ("depthkv", "routed", "gracekv"),
    "layer and head allocators": ("pyramidkv", "cake", "adakv", "layer-defensivekv", "kvzip", "dynamickv", "lava",
                                  "squeezeattention", "pyramidinfer", "compresskv", "lukv"),
    "2025-26 scorers": ("criticalkv", "criticaladakv", "defensivekv", "expected-attention", "keydiff"),
    "ceilings": CEILINGS,
}

# The fixed sets of values an option takes: the CLI declares them as choices (so --help shows them and a
# wrong value fails while parsing), and the libraries check the same tuples when called directly.
PROTOCOLS = ("with-question", "context-only")  # `eval --protocol`, ripplekv.generate(protocol=)
SUITES = ("offline", "longbench", "longbench-e")  # `--suite`
DECODE_BUDGETS = ("prompt", "total")  # `eval --decode-budget`: what B counts (prompt entries, or prompt + decoded)
SIGNALS = ("noise", "evict", "infonce")  # `profile --signal`
MEASURES = ("task-drop", "kl")  # `profile --signal evict --measure`: DepthKV's task-metric drop, or KL at probe tokens
MAPS = ("exponential", "proportional")  # `allocate --map`
DTYPES = ("auto", "float32", "bfloat16", "float16")  # `--dtype`
ROUGE_CHOICES = ("official", "rouge-score")  # `report/score --rouge`
POOLINGS = ("max", "avg", "none")  # `--pooling`, snapkv:pooling=
FORMATS = ("table", "csv")  # `budgets --format`

# Profile settings that the command, ProfileSettings and the scripts share.
PROFILE_SEEDS = 1  # noise draws per calibration sample (`make reproduce` uses 2)
PROFILE_ETA = 0.3  # noise scale relative to each value vector's RMS
PROBE_TOKENS = 16  # final prompt tokens used as probes (profile and route)
PRUNE_RATIO = 0.6  # `profile --measure task-drop`: the share of a layer's prompt entries pruned (DepthKV's headline)
