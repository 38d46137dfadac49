"""SnapKV scoring: the observation window's attention over the prefix, pooled, picks the top entries per KV head.

The last `window` prompt tokens are the observation window and are always kept. Their attention to each
earlier entry (softmax over the causal prefix, summed over window queries) is smoothed by 1-D pooling
and the top entries per KV head are kept. With grouped KV heads, a KV head's score is the mean over the
query heads that share it, taken *before* pooling: the kept entries are stored once per KV head, so the
score must rank them for the whole group, and pooling the mean is the same as averaging pooled heads
for average pooling (and close to it for max pooling).

Defaults and their sources: the SnapKV repository's `init_snapkv` uses window 32, kernel 5 and average
pooling; KVCache-Factory's LongBench script uses window 8, kernel 7 and max pooling. We keep window 32
(SnapKV's) with kernel 7 and max pooling (KVCache-Factory's), the setting our earlier results use;
`--window`, `--kernel`, `--pooling` (or `snapkv:window=..`) choose others. Average pooling counts the
zero padding at the two edges (`count_include_pad=True`), as the original code and kvpress do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ripplekv.defaults import POOLINGS
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import COMPOSITION, Scorer, check_positive, register_scorer
from ripplekv.methods.core.chunks import check_chunking, chunked_keep
from ripplekv.methods.core.selection import window_or_top


def check_pooling(pooling: str) -> None:
    """The one check of a `pooling=` option (SnapKV's scorer and the allocators that pool its way)."""
    if pooling not in POOLINGS:
        raise UserError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")


def pooling_unused(kernel: int, pooling: str) -> dict[str, str]:
    """Which of `kernel` and `pooling` changes nothing: pooling with kernel=1, the kernel with pooling=none."""
    unused = {}
    if kernel == 1:
        unused["pooling"] = "kernel=1 pools nothing"
    if pooling == "none":
        unused["kernel"] = "pooling=none uses no kernel"
    return unused


def pooled(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """`scores` [..., m] smoothed along their last axis by 1-D pooling (same length; the edges zero-padded).
    An empty prefix (a prompt no longer than the window: m = 0) has nothing to smooth and comes back as it is;
    torch's pooling refuses an empty axis."""
    if kernel == 1 or pooling == "none" or scores.shape[-1] == 0:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    flat = scores.reshape(-1, 1, scores.shape[-1])
    return pool(flat, kernel, stride=1, padding=kernel // 2)[..., : scores.shape[-1]].reshape(scores.shape)


def window_attention(state: PrefillState, layer: int, window: int, who: str = "SnapKV") -> torch.Tensor:
    """Attention [H_kv, group, window, n] (float32) of the last `window` prompt queries over all keys."""
    queries = state.window_queries(layer, window, who).float()  # [H_q, w, d]
    keys = state.keys[layer].float()  # [H_kv, n, d]
    kv_heads, length = keys.shape[0], keys.shape[1]
    group = queries.shape[0] // kv_heads
    logits = torch.matmul(queries.reshape(kv_heads, group * window, -1), keys.transpose(-1, -2)) * state.scaling
    # Window query i sits at position n - w + i and sees keys up to it (on a sliding layer, only its window's).
    positions = torch.arange(length, device=keys.device)
    at = (length - window + torch.arange(window, device=keys.device))[:, None]
    visible = positions[None, :] <= at
    if getattr(state, "windows", None) and state.windows[layer] is not None:
        visible &= positions[None, :] > at - state.windows[layer]
    logits = logits.masked_fill(~visible.repeat(group, 1), float("-inf"))
    return torch.softmax(logits, dim=-1).view(kv_heads, group, window, length)


def window_scores(state: PrefillState, layer: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """Pooled attention mass [H_kv, n - window] that the last `window` queries give each prefix entry (once per
    prefill and options)."""
    return state.memo((pooled_window_mass, layer, window, kernel, pooling),
                      lambda: pooled_window_mass(state, layer, window, kernel, pooling))


def pooled_window_mass(state: PrefillState, layer: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    mass = window_attention(state, layer, window).sum(2).mean(1)
    length = mass.shape[1]
    return pooled(mass[:, : length - window], kernel, pooling)


def _then_check_chunks(post_init):
    @functools.wraps(post_init)
    def checked(self):
        post_init(self)
        WindowScorer.__post_init__(self)

    return checked


@dataclass(frozen=True)
class WindowScorer(Scorer):
    """A scorer that always keeps the last `window` tokens and ranks the prefix before them.

    Each takes chunk-level selection as options (`methods.core.chunks`): `chunk_length=` keeps whole chunks by
    their scores summed over the layer's heads (ChunkKV), with `gate=entropy` (and `spiky_keep=`) thinning spiky
    chunks, or `segment_length=` gives each segment of the prompt its share (kvpress's ChunkPress);
    `chunk_rounding=kvpress` keeps kvpress's counts instead of exactly the budget. A subclass that selects in its
    own way (overrides `keep`) refuses them."""

    window: int = 32
    chunk_length: int | None = field(default=None, kw_only=True, metadata=COMPOSITION)
    segment_length: int | None = field(default=None, kw_only=True, metadata=COMPOSITION)
    gate: str | None = field(default=None, kw_only=True, metadata=COMPOSITION)
    spiky_keep: int | None = field(default=None, kw_only=True, metadata=COMPOSITION)
    chunk_rounding: str | None = field(default=None, kw_only=True, metadata=COMPOSITION)

    def __init_subclass__(cls, **kwargs):
        """A subclass's own `__post_init__` checks the chunk options too (few of them call their parent's)."""
        super().__init_subclass__(**kwargs)
        if "__post_init__" in cls.__dict__:
            cls.__post_init__ = _then_check_chunks(cls.__dict__["__post_init__"])

    def __post_init__(self):
        check_chunking(self, type(self).keep is not WindowScorer.keep)

    @property
    def chunked(self) -> bool:
        return self.chunk_length is not None or self.segment_length is not None

    @property
    def rounds_counts(self) -> bool:
        return self.chunk_rounding == "kvpress"

    def floor(self) -> int:
        return self.window

    def keeps_top_scores(self) -> bool:
        return type(self).keep is WindowScorer.keep and not self.chunked

    def degenerate(self, budget: int) -> str | None:
        if self.window >= budget:
            return (f"its window ({self.window}) is at least the budget, so every layer keeps only its {budget} "
                    "most recent entries (recency, no scoring)")
        return None

    def keep(self, state, layer, counts):
        window = min(self.window, state.length)
        select = None
        if self.chunked:
            start = state.held_from(layer) if hasattr(state, "held_from") else 0

            def select(scores, heads, count):
                return chunked_keep(self, scores, heads, state.length, window, start, count)

        return window_or_top(state.num_kv_heads, state.length, counts, window, lambda: self.scores(state, layer),
                             select, state.device)


@register_scorer("snapkv")
@dataclass(frozen=True)
class SnapKVScorer(WindowScorer):
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        check_pooling(self.pooling)
        check_positive(window=self.window, kernel=self.kernel)

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)  # the observation window's queries

    def unused_options(self) -> dict[str, str]:
        return pooling_unused(self.kernel, self.pooling)

    def decode_policy(self, every: int):
        from ripplekv.methods.core.decoding import Rescored

        if type(self) is not SnapKVScorer or self.chunked:  # a subclass (CriticalKV) scores differently, chunks
            return None  # select differently: each must say how itself
        return Rescored(self.window, self.kernel, self.pooling, every)

    def scores(self, state, layer):
        return window_scores(state, layer, min(self.window, state.length), self.kernel, self.pooling)
