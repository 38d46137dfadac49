"""Chunk-level selection, an option of every scorer that keeps a window and ranks the prefix by its scores
(`snapkv.WindowScorer`): `chunk_length=` (ChunkKV), `gate=entropy` (kvpress's entropy-gated ChunkKV) and
`segment_length=` (kvpress's ChunkPress). Each rule gets the scorer's scores and a head's count and returns
the positions that head keeps; the window is kept first, as without chunks.

- **ChunkKV** (arXiv 2502.00299, kvpress `ChunkKVPress`): the positions before the window are cut into chunks
  of `chunk_length` from the first the layer holds (the last chunk may be shorter); a chunk's score is the
  mean over its positions of the scores summed over the layer's KV heads, so every head ranks the same chunks.
  Whole chunks are kept in that order while they fit in the head's count; the remainder comes from the next
  chunk in that order, its highest summed scores first (ties to the earlier position), so a head keeps exactly
  its count. The paper keeps whole chunks only (fewer than the budget); kvpress keeps
  `max(1, int(chunks x (1 - ratio)))` whole chunks laid over the whole prompt, window included, whatever
  they add up to: `chunk_rounding=kvpress` does that, at ratio `1 - count / n` (the window's entries rank above
  every prefix entry, as kvpress's SnapKV pads them), for make check-references.
- **Entropy gate** (kvpress `EntropyGatedChunkKVPress`): chunks at or above the median chunk score whose
  normalized score entropy is below the median entropy (important but spiky) keep only their `spiky_keep`
  highest entries; chunks are visited by score, each taking what it may until the count is spent, and what
  spiky chunks leave is topped up with the highest remaining entries. The count is exact by construction.
- **ChunkPress** (kvpress `ChunkPress`, after FINCH): the positions before the window are cut into segments of
  `segment_length`; each keeps its share of the head's count (proportional to its length, the remainder by
  largest fraction, ties to the earlier segment), chosen by the head's own scores within it. kvpress gives each
  segment `max(1, int(length x (1 - ratio)))` over the whole prompt (`chunk_rounding=kvpress`). Our scores are
  the scorer's over the whole prompt; kvpress re-runs its scorer on each segment alone, the same for scorers
  of one entry at a time (KNorm), not for those that read other entries (SnapKV's window, KeyDiff's mean key).
"""

from __future__ import annotations

import math

import torch

from ripplekv.errors import UserError
from ripplekv.methods.core.selection import top_indices

GATES = ("entropy",)
ROUNDINGS = ("exact", "kvpress")
DEFAULT_SPIKY_KEEP = 4  # kvpress's low_entropy_chunk_length
ENTROPY_EPSILON = 1e-8  # kvpress's, in the normalization and the log


def check_chunking(scorer, own_keep: bool) -> None:
    """One line for each option mistake; fills `spiky_keep`'s default and drops `chunk_rounding=exact` (the default),
    so two spellings of one selection describe alike. `own_keep`: the scorer selects in its own way (H2O's halves,
    CriticalKV's stages), so chunks cannot replace its selection."""
    chunk, segment = scorer.chunk_length, scorer.segment_length
    for key in ("chunk_length", "segment_length", "spiky_keep"):
        value = getattr(scorer, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"option {key} must be a positive integer, got {value!r}")
    if chunk is not None and segment is not None:
        raise UserError("give chunk_length (ChunkKV: whole chunks) or segment_length (ChunkPress: each segment its "
                        "share), not both")
    if scorer.gate is not None and scorer.gate not in GATES:
        raise UserError(f"option gate must be one of {', '.join(GATES)}, got {scorer.gate!r}")
    if scorer.gate is not None and chunk is None:
        raise UserError("gate=entropy gates ChunkKV's chunks: add chunk_length= (kvpress's default for it is 10)")
    if scorer.spiky_keep is not None and scorer.gate is None:
        raise UserError("option spiky_keep only applies with gate=entropy")
    if scorer.gate is not None:
        keep = scorer.spiky_keep or DEFAULT_SPIKY_KEEP
        if not chunk > keep:
            raise UserError(f"with gate=entropy chunk_length ({chunk}) must exceed spiky_keep ({keep})")
        object.__setattr__(scorer, "spiky_keep", keep)
    rounding = scorer.chunk_rounding
    if rounding is not None and rounding not in ROUNDINGS:
        raise UserError(f"option chunk_rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    if rounding is not None and chunk is None and segment is None:
        raise UserError("option chunk_rounding only applies with chunk_length= or segment_length=")
    if rounding == "kvpress" and scorer.gate is not None:
        raise UserError("gate=entropy keeps exactly the budget, as kvpress's press does; drop chunk_rounding")
    if rounding == "exact":
        object.__setattr__(scorer, "chunk_rounding", None)
    if own_keep and (chunk is not None or segment is not None):
        raise UserError(f"scorer {scorer.name} selects in its own way, so chunks cannot replace its selection; "
                        "chunk_length= and segment_length= apply to scorers that keep a window and rank the rest "
                        "(snapkv, keydiff, expected-attention, knorm, ...)")


def bounds(start: int, stop: int, length: int) -> list[tuple[int, int]]:
    """[a, b) of consecutive pieces of `length` from `start` to `stop` (the last may be shorter)."""
    return [(a, min(a + length, stop)) for a in range(start, stop, length)]


def piece_means(scores: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Mean of 1-D `scores` over each piece (complete pieces in one reshape, a short last one alone)."""
    start, width = pieces[0][0], pieces[0][1] - pieces[0][0]
    whole = sum(1 for a, b in pieces if b - a == width)
    means = scores[start: start + whole * width].view(whole, width).mean(1)
    if whole < len(pieces):
        a, b = pieces[-1]
        means = torch.cat([means, scores[a:b].mean().view(1)])
    return means


def whole_chunks(summed: torch.Tensor, start: int, stop: int, chunk: int, extra: int) -> torch.Tensor:
    """Bool [len(summed)]: `extra` positions in [start, stop), whole chunks by mean score, the rest from the next."""
    mask = torch.zeros(summed.shape[0], dtype=torch.bool, device=summed.device)
    if extra <= 0:
        return mask
    pieces = bounds(start, stop, chunk)
    order = top_indices(piece_means(summed, pieces), len(pieces)).tolist()
    for index in order:
        a, b = pieces[index]
        if b - a > extra:
            mask[a + top_indices(summed[a:b], extra)] = True
            break
        mask[a:b] = True
        extra -= b - a
        if extra == 0:
            break
    return mask


def kvpress_chunks(summed: torch.Tensor, start: int, chunk: int, count: int) -> torch.Tensor:
    """Bool [n]: kvpress's ChunkKV over the held positions [start, n) (window entries at +inf in `summed`):
    its top `max(1, int(chunks x (1 - ratio)))` chunks by mean, ratio = 1 - count / held, whatever they add to."""
    length = summed.shape[0]
    pieces = bounds(start, length, chunk)
    ratio = 1 - count / (length - start)
    keep = max(1, int(len(pieces) * (1 - ratio)))
    mask = torch.zeros(length, dtype=torch.bool, device=summed.device)
    for index in top_indices(piece_means(summed, pieces), keep).tolist():
        a, b = pieces[index]
        mask[a:b] = True
    return mask


def normalized_entropy(values: torch.Tensor) -> torch.Tensor:
    """[k]: the entropy of each row of [k, width] scores as a distribution (rows with a negative entry shifted up to
    a zero minimum), divided by log(width) and clipped to [0, 1]; a single entry has none."""
    width = values.shape[-1]
    if width == 1:
        return torch.zeros(values.shape[0], device=values.device)
    shifted = values - values.amin(-1, keepdim=True).clamp(max=0.0)
    p = shifted / (shifted.sum(-1, keepdim=True) + ENTROPY_EPSILON)
    return (-(p * (p + ENTROPY_EPSILON).log()).sum(-1) / math.log(width)).clamp(0.0, 1.0)


def gated_chunks(summed: torch.Tensor, start: int, stop: int, chunk: int, spiky: int, extra: int) -> torch.Tensor:
    """Bool [len(summed)]: exactly `extra` positions in [start, stop) by the entropy-gated rule (module docstring)."""
    mask = torch.zeros(summed.shape[0], dtype=torch.bool, device=summed.device)
    if extra <= 0:
        return mask
    pieces = bounds(start, stop, chunk)
    means = piece_means(summed, pieces)
    whole = [piece for piece in pieces if piece[1] - piece[0] == chunk]
    rows = summed[start: start + len(whole) * chunk].view(len(whole), chunk)
    entropy = normalized_entropy(rows)
    if len(whole) < len(pieces):
        a, b = pieces[-1]
        entropy = torch.cat([entropy, normalized_entropy(summed[a:b].view(1, -1))])
    spiky_chunk = (means >= means.median()) & (entropy < entropy.median())  # torch's median: the lower middle
    left = extra
    for index in top_indices(means, len(pieces)).tolist():
        a, b = pieces[index]
        take = min(b - a, left, spiky if bool(spiky_chunk[index]) else b - a)
        if take == b - a:
            mask[a:b] = True
        else:
            mask[a + top_indices(summed[a:b], take)] = True
        left -= take
        if left == 0:
            return mask
    rest = torch.arange(start, stop, device=summed.device)[~mask[start:stop]]
    mask[rest[top_indices(summed[rest], left)]] = True
    return mask


def segment_shares(extra: int, pieces: list[tuple[int, int]]) -> list[int]:
    """`extra` split over the pieces in proportion to their lengths, exactly: floors, then one more to the largest
    remainders (ties to the earlier piece); integer arithmetic, so no rounding can drift."""
    total = sum(b - a for a, b in pieces)
    shares = [extra * (b - a) // total for a, b in pieces]
    remainders = [extra * (b - a) % total for a, b in pieces]
    for index in sorted(range(len(pieces)), key=lambda i: (-remainders[i], i))[: extra - sum(shares)]:
        shares[index] += 1
    return shares


def segments(scores: torch.Tensor, pieces: list[tuple[int, int]], shares: list[int]) -> torch.Tensor:
    """Bool [H, n]: in each piece, each head's top `share` positions by its own scores [H, n]."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for (a, b), share in zip(pieces, shares, strict=True):
        if share > 0:
            mask[:, a:b].scatter_(1, top_indices(scores[:, a:b], share), True)
    return mask


def chunked_keep(scorer, scores: torch.Tensor, heads: slice, length: int, window: int, start: int,
                 count: int) -> torch.Tensor:
    """Bool [h, n] for the `heads` (of the layer's prefix `scores` [H, n - window]) that keep `count` entries each,
    `count` above the window: the window, then the positions the scorer's chunk rule picks (positions before
    `start`, which the layer cannot hold, never). Chunks rank by every head's scores, whichever heads ask."""
    prefix = scores.shape[1]
    padded = torch.full((scores.shape[0], length), float("inf"), device=scores.device)  # the window above the rest
    padded[:, :prefix] = scores.float()
    mine = padded[heads]
    kvpress = scorer.chunk_rounding == "kvpress"
    stop = length if kvpress else prefix
    if scorer.segment_length is not None:
        pieces = bounds(start, stop, scorer.segment_length)
        if kvpress:
            ratio = 1 - count / (length - start)
            return segments(mine, pieces, [max(1, int((b - a) * (1 - ratio))) for a, b in pieces])
        kept = segments(mine, pieces, segment_shares(count - window, pieces))
        kept[:, prefix:] = True
        return kept
    if kvpress and length - start < scorer.chunk_length:  # kvpress hands a prompt shorter than a chunk to its scorer
        return segments(mine, [(start, length)], [count])
    summed = padded.sum(0)
    if kvpress:  # whole chunks only: the window is kept where its chunks are (they rank first)
        row = kvpress_chunks(summed, start, scorer.chunk_length, count)
    else:
        rule = gated_chunks if scorer.gate is not None else whole_chunks
        options = (scorer.spiky_keep,) if scorer.gate is not None else ()
        row = rule(summed, start, stop, scorer.chunk_length, *options, count - window)
        row[prefix:] = True
    return row.expand(mine.shape[0], length).clone()
