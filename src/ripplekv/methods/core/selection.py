"""How a head's kept entries are picked from its scores: the top scores as a stable sort ranks them, ties to the
lower index (so a selection is a function of the scores, never of the device), the most recent window, and a
rule applied head by head only when heads keep different counts. Every scorer selects through these."""

from __future__ import annotations

from collections.abc import Callable

import torch


def recent_mask(num_heads: int, length: int, count: int, device=None) -> torch.Tensor:
    """Keep the last `count` positions in every head."""
    mask = torch.zeros(num_heads, length, dtype=torch.bool, device=device)
    if count > 0:
        mask[:, length - count :] = True
    return mask


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` highest scores along the last dimension, highest first; among equal scores the
    lowest index wins. Every selection ranks as this does (`top_mask` keeps the same set): a stable sort makes the
    choice a function of the scores alone, where `torch.topk` leaves ties to its kernel (CPU and CUDA keep different tied entries,
    and max-pooled scores tie often)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]


def top_mask(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The positions `top_indices(scores, count)` picks, as a mask, without sorting everything: each score above
    the count-th highest, then the lowest-indexed of those equal to it. A full sort of a 3.5k-entry head took 7x
    as long as `torch.topk`; scores with a NaN take the sort, where NaN ranks highest."""
    if count <= 0 or count >= scores.shape[-1] or bool(scores.isnan().any()):
        mask = torch.zeros_like(scores, dtype=torch.bool)
        return mask.scatter_(-1, top_indices(scores, max(count, 0)), True)
    cut = torch.topk(scores, count, dim=-1).values[..., -1:]
    above = scores > cut
    tied = scores == cut
    return above | (tied & (tied.cumsum(-1) <= count - above.sum(-1, keepdim=True)))


def top_scored_mask(scores: torch.Tensor, length: int, window: int, count: int) -> torch.Tensor:
    """Keep the window (or its last `count` entries) plus the top `count - window` prefix entries per head.

    `scores` [H, n - window] rank the prefix; the window is the last `window` positions.
    """
    kept_window = min(window, count)
    mask = recent_mask(scores.shape[0], length, kept_window, scores.device)
    extra = count - kept_window
    if extra > 0:
        mask[:, : scores.shape[1]] |= top_mask(scores, extra)
    return mask


def per_head(counts: torch.Tensor, build: Callable[[slice, int], torch.Tensor]) -> torch.Tensor:
    """Apply `build(heads, count)` once when every head keeps the same count, else head by head."""
    values = [int(c) for c in counts.tolist()]
    if len(set(values)) == 1:
        return build(slice(None), values[0])
    return torch.cat([build(slice(h, h + 1), count) for h, count in enumerate(values)])


def window_or_top(num_heads: int, length: int, counts: torch.Tensor, window: int,
                  prefix_scores: Callable[[], torch.Tensor], select=None, device=None) -> torch.Tensor:
    """Bool [H, length]: per head, only the most recent entries where its count is within `window`, else the
    window and the top of the prefix's scores (`prefix_scores()` is computed once, on first need; `select(scores,
    heads, count)` replaces the top-k, as chunk-level selection does)."""
    scores = None

    def build(heads, count):
        nonlocal scores
        if count <= window:
            return recent_mask(num_heads, length, count, device)[heads]
        if scores is None:
            scores = prefix_scores()
        if select is not None:
            return select(scores, heads, count)
        return top_scored_mask(scores[heads], length, window, count)

    return per_head(counts, build)
