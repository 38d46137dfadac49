"""LagKV: score each entry against the partition that follows it, from keys and values alone (no attention).

Our reading of Liang et al. (2025), "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important" (arXiv 2504.04704), as kvpress's LagKVPress scores it (read, not copied). After the first `n_sink`
entries the prompt is cut into partitions of `lag_size`. For every partition but the last whole one, each
channel of its keys is min-max normalized by the next partition's range in that channel (the "lag" reference);
an entry's key score is the standard deviation of its normalized channels, softmaxed over the entries of its
partition; the same for values, and the two are averaged. By default (`cross_scoring=0`) the scores become
ranks within each partition (rank / lag_size), so every partition gives up entries at the same rate; with
`cross_scoring=1` the softmaxed scores compete across partitions (kvpress's experimental option). The sinks and
the tail (the last whole partition and what follows it) score 1, above every rank, so they are kept first. A
prompt shorter than `n_sink + 2 lag_size` has no reference to score against: the sinks, then the most recent
entries (kvpress's ramp). Defaults follow kvpress: n_sink 4, lag_size 128, cross_scoring off, and no window
(`window=0`: the tail already holds the last 128+ tokens, the question among them). Ours: a channel constant
over its reference partition (where kvpress divides by zero) is measured against a range of 1. Ranks tie
across partitions by design; a tie goes to the earlier entry (`core.selection.top_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_integers, register_scorer
from ripplekv.methods.snapkv import WindowScorer


def lag_relative(states: torch.Tensor, lag: int) -> torch.Tensor:
    """[H, P - 1, lag]: for partitions [H, P, lag, d] of keys or values, each entry's spread of channels normalized
    by the next partition's per-channel range, softmaxed within its partition."""
    reference = states[:, 1:]
    low = reference.amin(2, keepdim=True)
    span = reference.amax(2, keepdim=True) - low
    span = torch.where(span > 0, span, torch.ones_like(span))
    return ((states[:, :-1] - low) / span).std(-1).softmax(-1)


def lag_scores(keys: torch.Tensor, values: torch.Tensor, n_sink: int, lag: int, cross: bool) -> torch.Tensor:
    """LagKV's scores [H, n] of every entry from keys and values [H, n, d] (float32; the module docstring)."""
    heads, length, dim = keys.shape
    scores = torch.ones(heads, length, device=keys.device)
    if length < n_sink + 2 * lag:
        if length > n_sink:
            scores[:, n_sink:] = torch.arange(length - n_sink, device=keys.device) / (length - n_sink)
        return scores
    parts = (length - n_sink) // lag
    scored = slice(n_sink, n_sink + (parts - 1) * lag)  # every partition with a next one to measure against
    end = n_sink + parts * lag

    def relative(states):
        return lag_relative(states[:, n_sink:end].reshape(heads, parts, lag, dim), lag)

    lagged = (relative(keys) + relative(values)) / 2  # [H, parts - 1, lag]
    if not cross:
        lagged = lagged.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True) / lag
    scores[:, scored] = lagged.reshape(heads, -1)
    return scores


@register_scorer("lagkv")
@dataclass(frozen=True)
class LagKVScorer(WindowScorer):
    window: int = 0
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: int = 0

    def __post_init__(self):
        check_integers({"window": self.window, "n_sink": self.n_sink}, minimum=0)
        check_integers({"lag_size": self.lag_size})
        if self.cross_scoring not in (0, 1):
            raise UserError(f"option cross_scoring must be 0 or 1, got {self.cross_scoring!r}")

    def floor(self) -> int:
        return max(self.window, 1)

    def scores(self, state, layer):
        options = (self.n_sink, self.lag_size, self.cross_scoring)
        every = state.memo((lag_scores, layer, *options), lambda: lag_scores(
            state.keys[layer].float(), state.values[layer].float(), *options[:2], bool(self.cross_scoring)))
        return every[:, : state.length - min(self.window, state.length)]
