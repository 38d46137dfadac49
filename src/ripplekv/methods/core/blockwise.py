"""Which methods can evict block by block (`eval --protocol blockwise`, `engine.blockwise`), decided per family.

A block-wise read is scored as a prompt of its own: the kept entries, then the block, its last queries the
observation window (kvpress's BlockPress and KeyDiff's setting: scores over the block's own window). Every (layer,
KV head) keeps B after every block, as BlockPress keeps one ratio in every head. So a method runs block-wise when:
- it is a plain selection: an allocator x a scorer, without merge=, rerotate=, quant= or think= (each changes the
  kept entries in a way a later block would have to undo) and not a method of its own (GraceKV's prototypes, KIVI);
- its allocator gives every layer and head the same count (`uniform`, split even): layer and head allocators
  (PyramidKV, AdaKV, CAKE, the global competitions, allocation files) spread a whole prompt's scores, which no
  block sees;
- its scorer ranks from keys, values and the window's queries alone, in index order (`PER_BLOCK_SCORERS`). Scorers
  that read a signal recorded over the whole prompt (H2O's column sums, KVzip's and KVgrad's second pass, Finch's
  question, the oracle's answer, KVzap's hidden states) or a prompt position (Expected Attention's future queries,
  LagKV's partitions, Leverage's pre-RoPE keys) have no per-block reading here and are refused, as is chunked
  selection (`chunk_length=`, `segment_length=`: chunks of prompt positions).
"""

from __future__ import annotations

from ripplekv.errors import UserError
from ripplekv.methods.core.base import AllocatorScorer
from ripplekv.methods.core.registry import SCORERS

# SnapKV's and TOVA's window attention (index-causal within the block), KeyDiff's and KNorm's keys, StreamingLLM's
# order (sinks first, recent last), random: each reads the kept entries then the block as a prompt.
PER_BLOCK_SCORERS = ("snapkv", "tova", "keydiff", "knorm", "recency", "random")


def blockwise_refusal(method) -> str | None:
    """Why `method` cannot evict block by block (None: it can)."""
    if type(method) is not AllocatorScorer:
        return ("it is not a plain selection (an entry option, quantized storage, key channels or a method of its own), "
                "which has no per-block form here")
    if method.is_full:
        return None
    allocator, scorer = method.allocator, method.scorer
    if allocator.name != "uniform" or allocator.splits_heads:
        return (f"its allocator ({allocator.name}{', split=' + allocator.split if allocator.splits_heads else ''}) "
                "spreads the budget over layers or heads by the whole prompt; block by block every layer and head keeps B")
    if scorer.name not in PER_BLOCK_SCORERS or SCORERS.get(scorer.name) is not type(scorer):
        return (f"its scorer ({scorer.name}) is not one that ranks a block's entries from keys, values and the "
                "block's window alone (it reads the whole prompt, prompt positions or more)")
    if getattr(scorer, "chunked", False):
        return "chunked selection groups prompt positions, which a block's kept entries no longer are"
    return None


def check_blockwise(methods: dict, block: int) -> None:
    """Refuse, in one line and before any model work, a block size below 1 or under a method's observation window,
    and the methods that cannot evict block by block."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise UserError(f"--block-tokens must be a positive number of tokens, got {block!r}")
    for label, method in methods.items():
        why = blockwise_refusal(method)
        if why:
            raise UserError(f"{label} cannot run under --protocol blockwise: {why}; it runs "
                            f"{', '.join(PER_BLOCK_SCORERS)} scorers with the uniform allocator (e.g. snapkv, keydiff, "
                            "knorm, streamingllm, tova, random): drop it from --methods")
        window = method.requirements().capture_window
        if window > block:
            raise UserError(f"{label}'s observation window ({window} tokens) is longer than a block "
                            f"(--block-tokens {block}): give --block-tokens {window} or more")
