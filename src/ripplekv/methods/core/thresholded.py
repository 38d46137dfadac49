"""Threshold eviction (`METHOD:threshold=TAU`): keep every entry whose score is at or above tau, plus the scorer's
protected window, whatever the budget. kvpress's `DMSPress` over a scorer press, and KVzap's threshold mode
(`kvzap:threshold=TAU`), as we read them (not copied).

kvpress's DMSPress scores every prompt entry with the wrapped press, protects a sliding window of the most recent
tokens (its `sliding_window_size`, 128 by default) and evicts the older entries scoring below the threshold, per
KV head. Here the protected window is the scorer's own `window` (`kvzap:threshold=TAU:window=128` is KVzap's
paper and kvpress's default), the scores are the scorer's own (their scale is the scorer's: KVzap's are log
KVzip scores), and eviction happens once, after the prefill: DMSPress with `decoding=True` also evicts while
decoding, which this engine's grouped decode does not (the tokens a variant generates stay; `--decode-budget
total` refuses a threshold variant). A sliding-window layer keeps only what it holds.

The number of entries kept varies per prompt, layer and head, so B is not used: a threshold variant is never at a
budget. Reports leave it out of matched-budget ranks (`analysis.over_budget`) and place it on the memory axis
at the bytes it spent (`analysis.memory_axis`). Only a method whose scorer ranks single entries by its scores
and keeps the best (`Scorer.keeps_top_scores`) at a uniform allocation takes it: an allocator's shares or a
scorer's own rule (chunks, sinks) would change nothing or mean something else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.defaults import THRESHOLD as OPTION
from ripplekv.engine import entries as kv_entries
from ripplekv.engine.prefill import PrefillState
from ripplekv.errors import UserError
from ripplekv.methods.core.wrapped import Wrapped

THRESHOLD_HELP = ("threshold option (a scorer that ranks single entries, at uniform budgets): threshold=TAU keeps "
                  "every entry scoring at or above TAU plus the scorer's window, whatever B (kvpress DMSPress; "
                  "kvzap:threshold=TAU:window=128 is KVzap's threshold mode); its memory varies per prompt, so "
                  "reports put it on the memory axis at the bytes it spent, never on a matched-budget leaderboard")


def threshold_option(name: str, given: dict, spec: str, build):
    """A spec with `threshold=` (popped from `given`): the method without it, thresholded; None without it."""
    if OPTION not in given:
        return None
    text = given.pop(OPTION)
    try:
        tau = float(text)
    except ValueError:
        raise UserError(f"method spec {spec!r}: threshold must be a number (a score), got {text!r}") from None
    if not np.isfinite(tau):
        raise UserError(f"method spec {spec!r}: threshold must be a finite number, got {text!r}")
    method = build(":".join([name, *(f"{k}={v}" for k, v in given.items())]))
    scorer, allocator = getattr(method, "scorer", None), getattr(method, "allocator", None)
    if hasattr(allocator, "reading"):
        raise UserError(f"method spec {spec!r}: {name} has its own threshold mode: reading=threshold")
    if method.is_full or scorer is None or not scorer.keeps_top_scores():
        raise UserError(f"method spec {spec!r}: threshold= keeps the entries a scorer ranks above TAU; {name}'s "
                        "scorer does not rank single entries that way (use it on one that does, e.g. "
                        "kvzap:threshold=-4 or snapkv:threshold=0.01)")
    if not allocator.same_budget_every_layer or allocator.splits_heads:
        raise UserError(f"method spec {spec!r}: threshold= sets every head's entries by its scores, so {name}'s "
                        "allocator would change nothing; put its scorer at uniform budgets "
                        "(snapkv:scorer=NAME:threshold=TAU)")
    shown = str(int(tau)) if tau.is_integer() and abs(tau) < 1e16 else repr(tau)
    return Thresholded(f"{method.label}:threshold={shown}", method, tau)


@dataclass(frozen=True)
class Thresholded(Wrapped):
    """The method's scorer, keeping what scores at or above `tau` plus its window (see the module's docstring)."""

    tau: float = 0.0
    option = OPTION

    @property
    def prompt_dependent(self) -> bool:
        return True

    def own(self) -> dict:
        return {"tau": self.tau, "protected_window": self.inner.scorer.window}

    def degenerate(self, budget: int) -> str | None:
        return None  # B plays no part: nothing to degenerate to

    def layer_budgets(self, num_layers: int, budget: int, length) -> list[int]:
        raise UserError(f"{self.label} keeps what scores above its threshold: its entries depend on each prompt "
                        "(`ripplekv eval` records them per sample)")

    def mask(self, state: PrefillState, layer: int) -> torch.Tensor:
        """Bool [H_kv, n]: the entries at or above tau, and the last `window` (those a layer holds)."""
        return state.memo((Thresholded.mask, self.inner.scorer, self.tau, layer), lambda: self._mask(state, layer))

    def _mask(self, state: PrefillState, layer: int) -> torch.Tensor:
        scores = self.inner.scorer.scores(state, layer)  # [H_kv, m]: the candidates before the window
        kept = torch.zeros(state.num_kv_heads, state.length, dtype=torch.bool, device=state.device)
        scored = scores.shape[-1]
        kept[:, :scored] = scores >= self.tau  # what a layer cannot hold scores -inf (`base.held_only`)
        kept[:, scored:] = True
        start = state.held_from(layer) if hasattr(state, "held_from") else 0
        kept[:, :start] = False
        return kept

    def budgets(self, state: PrefillState, budget: int) -> np.ndarray:
        """[L, H_kv]: the entries each head keeps on this prompt (B is not used)."""
        return np.array([self.mask(state, layer).sum(1).tolist() for layer in range(state.num_layers)], dtype=np.int64)

    def compress(self, state: PrefillState, budget: int) -> list[kv_entries.LayerEntries]:
        built = []
        for layer in range(state.num_layers):
            mask = self.mask(state, layer)
            whole = bool(mask[:, state.held_from(layer) if hasattr(state, "held_from") else 0:].all())
            built.append(state.full_entries(layer) if whole
                         else kv_entries.gather(state.keys[layer], state.values[layer], mask))
        return built
