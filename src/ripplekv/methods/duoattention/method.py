"""DuoAttention (Xiao et al., arXiv 2410.10819): retrieval heads keep every entry, streaming heads keep attention
sinks + a recent window; which head is which comes from per-head gates fitted by the paper's distillation objective
(`methods.duoattention.objective`, `ripplekv fit duoattention`). Our reading of the paper and of kvpress 0.5.5's
`DuoAttentionPress` (read, not copied), which loads published gates for a few 8B models from the hub.

How many heads stream, kvpress's way: at budget B on an n-token prompt the target compression is 1 - B/n, and a
streaming head of w = sinks + recent entries saves 1 - w/n of its prompt, so a share (n - B) / (n - w) of the
L x H_kv heads stream; k = round(that x L x H_kv) heads with the lowest gates do (ties: the earlier layer, then
head). Then two readings:
- `rounding=exact` (ours, the default): the total stays exactly L x H_kv x B. Streaming heads keep w each and the
  retrieval heads share the rest evenly (largest remainder, ties to the earlier head). Where k was rounded up, a
  retrieval head holds a little less than the prompt and keeps its sinks + its most recent entries; where k was
  rounded down, retrieval heads would get more than the prompt: they keep all of it and what is left goes evenly
  to the streaming heads (longer recent windows). A budget below w (not even every head streaming fits, or a
  prompt no longer than w) makes every head keep B entries: its sinks and the most recent rest (`streamingllm`
  with the gates' sinks).
- `rounding=kvpress`: kvpress's counts, for make check-references: k streaming heads of w entries, every other head
  the whole prompt (every head streams at w when B < w), so the total drifts from L x H_kv x B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.core.base import FILE, Allocator, Scorer, register_allocator, register_scorer
from ripplekv.methods.core.budgets import check_budget
from ripplekv.methods.duoattention.gates import check_shape, gates_path, read_gates
from ripplekv.methods.streamingllm import sinks_and_recent

ROUNDINGS = ("exact", "kvpress")


def streaming_share(budget: int, length: int, window: int) -> float:
    """The share of heads that stream so that the cache keeps B of n entries per head on average (kvpress's
    compression ratio 1 - B/n over what one streaming head saves, 1 - w/n), in [0, 1]."""
    if budget >= length:
        return 0.0
    if length <= window:
        return 1.0
    return min(1.0, (length - budget) / (length - window))


def streaming_heads(gates: np.ndarray, budget: int, length: int, window: int) -> np.ndarray:
    """Bool [L, H]: the k heads with the lowest gates, k = round(share x L x H) (Python's round, as kvpress's)."""
    flat = np.asarray(gates, dtype=np.float64).reshape(-1)
    count = min(round(flat.size * streaming_share(budget, length, window)), flat.size)
    mask = np.zeros(flat.size, dtype=bool)
    mask[np.argsort(flat, kind="stable")[:count]] = True
    return mask.reshape(np.shape(gates))


def even_shares(total: int, count: int) -> np.ndarray:
    """`total` split into `count` integers differing by at most one, the larger ones first."""
    shares = np.full(count, total // count, dtype=np.int64)
    shares[: total - int(shares.sum())] += 1
    return shares


def head_counts(gates: np.ndarray, budget: int, length: int, sinks: int, recent: int,
                rounding: str = "exact") -> np.ndarray:
    """[L, H] entries per head (the module docstring's two readings)."""
    check_budget(budget)
    gates = np.asarray(gates, dtype=np.float64)
    heads, window = gates.size, sinks + recent
    if budget >= length:
        return np.full(gates.shape, length, dtype=np.int64)
    streaming = streaming_heads(gates, budget, length, window).reshape(-1)
    if rounding == "kvpress":
        return np.where(streaming, min(window, length), length).reshape(gates.shape).astype(np.int64)
    if budget < window or length <= window:
        return np.full(gates.shape, budget, dtype=np.int64)
    total, streams = heads * budget, int(streaming.sum())
    counts = np.zeros(heads, dtype=np.int64)
    retrieval = heads - streams
    if retrieval == 0:
        counts[:] = even_shares(total, heads)
    elif total - streams * window <= retrieval * length:
        counts[streaming] = window
        counts[~streaming] = even_shares(total - streams * window, retrieval)
    else:
        counts[~streaming] = length
        counts[streaming] = even_shares(total - retrieval * length, streams)
    return counts.reshape(gates.shape)


@dataclass(frozen=True)
class GatesFile:
    """The gates option, shared by the allocator and the scorer (the same option reaches both)."""

    gates: str | None = field(default=None, metadata=FILE)

    def fitted(self, state, bundled: bool | None = None) -> dict:
        """The gates file's contents (given, or shipped for the bundled model), checked against the model."""
        path = gates_path(self.gates, state, bundled)
        read = read_gates(path)
        check_shape(path, read["gates"], state.num_layers, state.num_kv_heads)
        return read

    def check_fitted(self, shape, bundled: bool, scorer=None) -> None:
        """Before any prefill: the gates exist and fit the model's (layers, KV heads); a prompt no longer than the
        budget never reads them, so only this check would say."""
        self.fitted(SimpleNamespace(num_layers=shape[0], num_kv_heads=shape[1]), bundled)


@register_allocator("duoattention")
@dataclass(frozen=True)
class DuoAttentionBudgets(GatesFile, Allocator):
    rounding: str = "exact"
    prompt_dependent = True
    prompt_note = ("its per-head counts follow its gates at each prompt's length; `ripplekv eval` records them per "
                   "sample")

    def __post_init__(self):
        self.check_heads()
        if self.rounding not in ROUNDINGS:
            raise UserError(f"option rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.gates is not None:
            read_gates(self.gates)  # a bad file is one line before any model work

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"duoattention's budgets differ by head; {self.prompt_note}")

    def allocate(self, state, budget, scorer):
        read = self.fitted(state)
        return head_counts(np.asarray(read["gates"]), budget, state.length, read["sinks"], read["recent"],
                           self.rounding)


@register_scorer("duoattention")
@dataclass(frozen=True)
class DuoAttentionKeep(GatesFile, Scorer):
    """Every head keeps its sinks (the gates file's) and the most recent rest of its count: a streaming head its
    window, a retrieval head everything (or all but the entries just after its sinks, where exact budgets leave it
    a little less than the prompt)."""

    same_for_every_head = True  # positions only

    def __post_init__(self):
        if self.gates is not None:
            read_gates(self.gates)

    def scores(self, state, layer):
        """Later tokens score higher, the sinks highest (what `keep` keeps first)."""
        sinks = self.fitted(state)["sinks"]
        order = torch.arange(state.length - 1, dtype=torch.float32, device=state.device)
        order[:sinks] = float(state.length)
        return order.expand(state.num_kv_heads, -1).clone()

    def keep(self, state, layer, counts):
        return sinks_and_recent(state, layer, counts, self.fitted(state)["sinks"])
