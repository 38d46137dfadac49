"""The methods the commands choose by default, named here so that no command names a method itself, and
the fixed choices and shared defaults of the commands' options.

Torch-free (the CLI shows these in --help without loading the engine); `methods.core.presets` checks that
each method named here is a preset.
"""

from pathlib import Path

DEFAULT_EVAL_METHODS = ("full", "streamingllm", "snapkv", "pyramidkv", "ripplekv")  # `eval --methods`
DEFAULT_ROUTE_CANDIDATES = ("snapkv", "streamingllm", "h2o", "tova", "knorm")  # `route --methods`
UNIFORM_BASELINES = ("uniform", "snapkv")  # what a report compares each method with, first one present
ALLOCATION_METHOD = "ripplekv"  # `allocate`: the method that turns multipliers into layer budgets
ALLOCATION_PLOT_BESIDE = "pyramidkv"  # `allocate`'s plot draws its layer budgets beside this method's
# `allocate`'s output by default, under the working directory: the allocation file budgets take when none is given
LAST_ALLOCATION = Path("runs/allocate/allocation.csv")
EVICTION_METHOD = "h2o"  # `profile --signal evict --evict-method`: DepthKV prunes with its own H2O-like pruner
# Answer-aware variants (they read the full cache's answer): reported beside the methods, never ranked; not all are
# bounds (`answer-allocation` is beaten by learned allocators).
CEILINGS = ("oracle", "answer-allocation", "allocation-ceiling")
# The option (`METHOD:threshold=TAU`) and the value of SimLayerKV's `reading=` that keep what scores above a
# threshold: a resolved spec with either spends memory that varies per prompt, so it is at no budget and never ranked.
THRESHOLD = "threshold"
# The fixed sets of values an option takes: the CLI declares them as choices (so --help shows them and a
# wrong value fails while parsing), and the libraries check the same tuples when called directly.
# `eval --protocol`; ripplekv.generate(protocol=) takes the single-question ones. The multi-question protocols ask one
# compressed context several questions: compressed without any question, or with the first in the window.
MULTI_QUESTION_PROTOCOLS = ("multi-question", "multi-question-first")
SINGLE_QUESTION_PROTOCOLS = ("with-question", "context-only")
# Block-wise prefill: the prompt read in blocks, each variant evicting after every block (one prefill per variant).
BLOCKWISE_PROTOCOL = "blockwise"
DEFAULT_BLOCK_TOKENS = 512  # `eval --block-tokens`: kvpress's BlockPress takes 128; a longer block, fewer reads
PROTOCOLS = (*SINGLE_QUESTION_PROTOCOLS, *MULTI_QUESTION_PROTOCOLS, BLOCKWISE_PROTOCOL)
SUITES = ("offline", "ruler", "longbench", "longbench-e", "longbench-v2", "scbench")  # `--suite`
GENERATED_SUITES = ("offline", "ruler")  # built here from a seed and --target-tokens (the others are read from files)
NEEDLE_TASK = "niah_depths"  # `needle --task`: RULER's niah_single_2 with the needle at each depth in turn
NEEDLE_LENGTHS = (1024, 2048, 4096)  # `needle --lengths`
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
# Variants decoded together (`eval --batch-size`, the API, the engine): a decoding step of 32 variants costs
# about what 16 cost, so the 22-variant bench eval decodes in half the time (docs/performance.md); groups still
# stay within --memory-budget.
EVAL_BATCH_SIZE = 32
# `ripplekv reproduce`: the presets an optional calibration stage feeds: preset -> (the option its file fills, the
# stage that makes it, options that stand in for that file). `route` reaches them through eval's --route.
PIPELINE_FED = {"depthkv": ("allocation", "allocate-depthkv", ()),
                "compresskv": ("profile", "compresskv-profile", ("errors",)),
                "routed": ("route", "route", ()), "routed-ripplekv": ("route", "route", ())}
PIPELINE_CURVES = "lukv"  # `ripplekv reproduce`'s lukv-profile stage profiles this preset's head-budget curves
# `ripplekv study` (pipeline.study): the allocations a study may cross with scorers and head splits as they are, and
# the calibrated ones with the file option their fitted file reaches them by (fitted per draw on the same prompts).
STUDY_FIXED_ALLOCATIONS = ("snapkv", "pyramidkv", "cake")
STUDY_CALIBRATED = {"ripplekv": "allocation", "lukv": "curve", "compresskv": "profile"}
# The results page (analysis.results_page): methods compared head to head when a run holds both (GraceKV against its
# earlier reading, each against SnapKV); the method of DepthKV's headline ratio and what its paper compares it with;
# the pruner an eviction profile names when it predates recording one.
HEAD_TO_HEAD = (("gracekv", "gracekv:slots=fixed"), ("gracekv", "snapkv"), ("gracekv:slots=fixed", "snapkv"))
HEADLINE_PRESET, HEADLINE_VERSUS = "depthkv", ("h2o", "snapkv")
EARLIER_EVICT_METHOD = "snapkv"
