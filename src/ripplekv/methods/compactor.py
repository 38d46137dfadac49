"""Compactor and its two parts: approximate leverage scores of the keys, and non-causal chunked attention.

Our reading of Chari & Van Durme (2025), "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores" (arXiv 2507.08143), as kvpress 0.5.5 scores it in `LeverageScorePress`,
`NonCausalAttnPress` and `CompactorPress` (read, not copied). Three scorers, each kvpress's press:

- `leverage`: a key's statistical leverage among its head's keys, before RoPE (the rotation undone from the
  stored keys). The keys are centred over the prompt and multiplied by a Gaussian sketch (d x k, k =
  `sketch_dimension` 48, entries N(0, 1/k)); the leverage of row x of the sketched matrix X is
  x^T (X^T X + j I)^{-1} x, the Gram matrix made positive definite by a jitter j (1e-2, raised tenfold while its
  Cholesky fails, as kvpress does). The scores are then z-normalised over the whole layer.
- `noncausal`: the prompt cut into chunks of `chunk_size` (256) tokens; inside a chunk every query attends to
  every key of the chunk (no causal mask, and, as kvpress, no 1/sqrt(d) scaling of the logits); a key's score
  is the attention its chunk's queries pay it, averaged over the query heads sharing its KV head, times its
  value's norm, smoothed by an average pool of width 3, z-normalised over the layer. The last chunk is padded
  with zero queries and keys that take part in its softmax, as kvpress's padding does. The attention is
  summed during the one prefill (a signal per chunk size, `noncausal_signal`), never kept per query.
- `compactor`: both over the prompt without its first `sink_size_start` (8) and last `sink_size_end` (4)
  tokens (the chunks start after the first sinks), blended as `blending` x leverage + attention; the sinks
  take the layer's highest score. kvpress's default blending is the compression ratio, 1 - kept / n; ours is
  the same per head, from the head's count (`blending=` fixes it). A head split or a competition across
  heads (`split=adakv`) compares `scores`, which blend at 0.35, kvpress's own fallback when no ratio is known.

The sketch is random in kvpress (torch's global generator, unseeded); here layer l's sketch is drawn from a
generator seeded with `seed` + l on the CPU, so a selection is a function of the prompt. Unlike kvpress, the
last `window` (32) tokens are always kept: kvpress compresses the context alone, our with-question protocol
compresses the question with it; `window=0` is kvpress's press (make check-references, which seeds kvpress's
draw the same way). A z-score over fewer than two entries is 0 (kvpress's would be undefined).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ripplekv.engine import adapter
from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import RECORDERS, PerLayer, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.core.base import (
    check_integers,
    check_positive,
    held_only,
    per_head,
    recent_mask,
    register_scorer,
    top_scored_mask,
)
from ripplekv.methods.snapkv import WindowScorer

KVPRESS_BLENDING = 0.35  # kvpress's blending when neither a blending nor a compression ratio is set
JITTER_TRIES = 5


# --------------------------------------------------------------------------- leverage


def prerope_keys(state, layer: int) -> torch.Tensor:
    """[H_kv, n, d] float32: the stored keys with RoPE undone (the keys the projection made), once per prefill."""

    def undo():
        keys = state.keys[layer].float()
        cos, sin = adapter.rope_at(state.model, torch.arange(state.length), keys, layer)
        return adapter.invert_rope(keys, cos.to(keys.device), sin.to(keys.device), adapter.rope_scale(state.model, layer))

    return state.memo((prerope_keys, layer), undo)


def gaussian_sketch(heads: int, dim: int, size: int, seed: int, device) -> torch.Tensor:
    """[heads, d, k] with entries N(0, 1/k), drawn on the CPU from `seed` (the same on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, dim, size, generator=generator) * (1 / math.sqrt(size)))[0].to(device)


def cholesky_with_jitter(gram: torch.Tensor) -> torch.Tensor:
    """The lower Cholesky factor of gram + j I for every head at once, j = 1e-2 raised tenfold until all succeed."""
    identity = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    jitter = 1e-2
    for _ in range(JITTER_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * identity)
        if bool((info == 0).all()):
            return factor
        jitter *= 10.0
    raise UserError(f"leverage scores: the sketched Gram matrix stayed singular up to a jitter of {jitter / 10:g} "
                    "(non-finite keys?)")


def leverage(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """[H, S]: each row's leverage x^T (X^T X + jI)^{-1} x in X = (keys centred over S) @ sketch, clamped at 0."""
    sketched = (keys - keys.mean(1, keepdim=True)) @ sketch  # [H, S, k]
    gram = sketched.transpose(-1, -2) @ sketched
    factor = cholesky_with_jitter((gram + gram.transpose(-1, -2)) / 2)
    solved = torch.cholesky_solve(sketched.transpose(-1, -2), factor)  # [H, k, S]
    return (sketched * solved.transpose(-1, -2)).sum(-1).clamp_min(0)


def z_scored(scores: torch.Tensor) -> torch.Tensor:
    """(scores - mean) / std over the whole tensor (a layer: every head), the std at least 1e-6."""
    if scores.numel() < 2:
        return torch.zeros_like(scores)
    return (scores - scores.mean()) / scores.std().clamp_min(1e-6)


def leverage_z(state, layer: int, sketch_dimension: int, seed: int, start: int = 0, stop: int | None = None):
    """Z-scored leverage [H_kv, stop - start] of the pre-RoPE keys at positions start..stop-1 (once per prefill)."""

    def compute():
        keys = prerope_keys(state, layer)[:, start:stop]
        if keys.shape[1] == 0:
            return keys.new_zeros(keys.shape[:2])
        sketch = gaussian_sketch(keys.shape[0], keys.shape[2], sketch_dimension, seed + layer, keys.device)
        return z_scored(leverage(keys, sketch))

    return state.memo((leverage_z, layer, sketch_dimension, seed, start, stop), compute)


# --------------------------------------------------------------------------- non-causal chunked attention


def chunk_attention(query: torch.Tensor, key: torch.Tensor, chunk: int) -> torch.Tensor:
    """[H_kv, S]: the attention (unscaled logits, softmax within each chunk of `chunk` positions, no causal mask)
    that each key's chunk's queries pay it, averaged over the query heads sharing its KV head. `query` [H_q, S, d],
    `key` [H_kv, S, d]; the last chunk is padded with zero queries and keys, which take part in its softmax."""
    kv_heads, length, dim = key.shape
    if length == 0:
        return key.new_zeros(kv_heads, 0, dtype=torch.float32)
    group = query.shape[0] // kv_heads
    padding = -length % chunk
    queries = F.pad(query.float(), (0, 0, 0, padding)).view(kv_heads, group, -1, chunk, dim)
    keys = F.pad(key.float(), (0, 0, 0, padding)).view(kv_heads, 1, -1, chunk, dim)
    sums = torch.zeros(kv_heads, group, queries.shape[2], chunk, device=key.device)
    for index in range(queries.shape[2]):  # one chunk at a time: [H_kv, group, chunk, chunk] scores at most
        weights = torch.softmax(queries[:, :, index] @ keys[:, :, index].transpose(-1, -2), dim=-1)
        sums[:, :, index] = weights.sum(-2)
    return sums.mean(1).reshape(kv_heads, -1)[:, :length]


def noncausal_signal(chunk: int, start: int = 0, end: int = 0) -> str:
    """The signal holding `chunk_attention` over the prompt without its first `start` and last `end` tokens (per
    layer [H_kv, S]); its recorder is registered on first use (one per chunking, as scorers ask for them)."""
    name = f"noncausal_attention_{chunk}_{start}_{end}"
    if name not in RECORDERS:
        register_recorder(name)(type(f"NonCausalAttention_{chunk}_{start}_{end}", (NonCausalAttention,),
                                     {"chunk": chunk, "start": start, "end": end, "__module__": __name__}))
    return name


def trimmed(length: int, start: int, end: int) -> tuple[int, int]:
    """The positions [first, stop) left once the first `start` and then the last `end` of `length` are set aside,
    as CompactorPress bounds its sinks."""
    first = min(start, length)
    return first, length - min(end, length - first)


class NonCausalAttention(PerLayer):
    """`chunk_attention` of a layer's prompt queries over its keys, between the sinks set aside."""

    chunk = 256
    start = 0
    end = 0

    def layer(self, index, query, key, value, attention_mask, scaling):
        first, stop = trimmed(key.shape[2], self.start, self.end)
        self.layers[index] = chunk_attention(query[0, :, first:stop], key[0, :, first:stop], self.chunk)


def attention_z(state, layer: int, chunk: int, start: int = 0, end: int = 0) -> torch.Tensor:
    """NonCausalAttnPress's scores [H_kv, S] between the sinks: chunk attention x ||v||, pooled (width 3), z-scored."""

    def compute():
        first, stop = trimmed(state.length, start, end)
        attention = state.signal(noncausal_signal(chunk, start, end))[layer]
        scores = attention * state.values[layer][:, first:stop].float().norm(dim=-1)
        if scores.shape[1] == 0:
            return scores
        return z_scored(F.avg_pool1d(scores[:, None], 3, stride=1, padding=1)[:, 0])

    return state.memo((attention_z, layer, chunk, start, end), compute)


# --------------------------------------------------------------------------- the scorers


@dataclass(frozen=True)
class PromptScorer(WindowScorer):
    """A scorer whose scores cover every prompt entry (`every`), cut to the prefix before the window."""

    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)

    def floor(self) -> int:
        return max(self.window, 1)

    def every(self, state, layer) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, state, layer):
        return self.every(state, layer)[:, : state.length - min(self.window, state.length)]


@register_scorer("leverage")
@dataclass(frozen=True)
class LeverageScorer(PromptScorer):
    sketch_dimension: int = 48
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_positive(sketch_dimension=self.sketch_dimension)
        check_integers({"seed": self.seed}, minimum=0)

    def every(self, state, layer):
        return leverage_z(state, layer, self.sketch_dimension, self.seed)


@register_scorer("noncausal")
@dataclass(frozen=True)
class NonCausalScorer(PromptScorer):
    chunk_size: int = 256

    def __post_init__(self):
        super().__post_init__()
        check_positive(chunk_size=self.chunk_size)

    def requirements(self) -> Requirements:
        return Requirements(signals={noncausal_signal(self.chunk_size)})

    def every(self, state, layer):
        return attention_z(state, layer, self.chunk_size)


@register_scorer("compactor")
@dataclass(frozen=True)
class CompactorScorer(PromptScorer):
    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None  # None: the compression ratio, 1 - kept / n, per head
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_positive(chunk_size=self.chunk_size, sketch_dimension=self.sketch_dimension)
        check_integers({"sink_size_start": self.sink_size_start, "sink_size_end": self.sink_size_end,
                        "seed": self.seed}, minimum=0)
        if self.blending is not None and not self.blending >= 0:
            raise UserError(f"option blending must be >= 0, got {self.blending!r}")

    def requirements(self) -> Requirements:
        return Requirements(signals={noncausal_signal(self.chunk_size, self.sink_size_start, self.sink_size_end)})

    def parts(self, state, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(leverage, attention), both z-scored [H_kv, S], over the prompt between the sinks."""
        first, stop = trimmed(state.length, self.sink_size_start, self.sink_size_end)
        return (leverage_z(state, layer, self.sketch_dimension, self.seed, first, stop),
                attention_z(state, layer, self.chunk_size, self.sink_size_start, self.sink_size_end))

    def blended(self, state, layer, blending: float) -> torch.Tensor:
        """[H_kv, n]: blending x leverage + attention, the sinks at the layer's highest score."""
        lever, attention = self.parts(state, layer)
        first, stop = trimmed(state.length, self.sink_size_start, self.sink_size_end)
        scores = blending * lever + attention
        top = scores.max() if scores.numel() else scores.new_zeros(())
        return F.pad(scores, (first, state.length - stop), value=float(top))

    def every(self, state, layer):
        return self.blended(state, layer, KVPRESS_BLENDING if self.blending is None else self.blending)

    def keep(self, state, layer, counts):
        if self.blending is not None:
            return super().keep(state, layer, counts)
        window = min(self.window, state.length)

        def build(heads, count):
            if count <= window:
                return recent_mask(state.num_kv_heads, state.length, count, state.device)[heads]
            scores = held_only(state, layer, self.blended(state, layer, 1 - count / state.length))
            scores = scores[heads, : state.length - window]
            return top_scored_mask(scores, state.length, window, count)

        return per_head(counts, build)


for _defaults in (NonCausalScorer(), CompactorScorer()):  # the presets' signals, registered with the package
    _defaults.requirements()
