"""KVCompose: attention from a second reading of the prompt, and layer budgets from composite tokens.

Our reading of "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens" (arXiv 2509.05165)
as kvpress 0.5.5's `KVComposePress` computes it (read, not copied). After the prefill the prompt is fed again
right after itself through the full cache (positions n..2n-1, `piece` tokens per forward); each query head's
attention to each prompt entry is reduced over those queries (`agg_task`: max, or mean), then over the query heads
sharing a KV head (`agg_group`: mean, or max); with `add_mean_across_heads` (the default) the layer's mean over its
KV heads is added to each head's scores, with `add_v_norm` they are multiplied by ||v||. That is the scorer.

The allocator (`kvcompose`) aligns heads: a layer's **composite tokens** are its heads' scores each sorted
from the highest, averaged rank by rank over the heads (`agg_head`: mean, or max), the first
`keep_token_lower_bound` ranks raised above all, and layer 0's composite raised to the largest of every
layer's at each rank. All layers' composite tokens compete for the L x (B - floor) entries beyond each layer's
floor (the window); a layer's winners plus its floor are its budget, and every head of the layer keeps that
many of its own top-scored entries (kvpress's structured cache: one length per layer). Exact integer budgets
keep the total at L x H_kv x B (kvpress clamps each layer at 1 entry after its top-k, which can add to it).
kvpress's unstructured variant (`structured=False`: one top-k over every head's sorted scores) is
`kvcompose:allocator=global:granularity=entry`; `kvcompose:rounding=kvpress` keeps kvpress's counts, clamp and all
(`kvpress_counts`, for make check-references).

Unlike kvpress, the last `window` (32) tokens are always kept: kvpress compresses the context alone, our
with-question protocol compresses the question with it; `kvcompose:window=0:rounding=kvpress` is `KVComposePress` (make
check-references). Cost: the second reading is a forward over n more tokens attending to up to 2n, about 2-3
prefills; kvpress runs it under eager attention, here sdpa attends and the scores take their own float32 softmax
block by block (`continuation.causal_attention_rows`), no map over the prompt kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.engine import timings
from ripplekv.errors import UserError
from ripplekv.methods.compactor import PromptScorer
from ripplekv.methods.core.base import Allocator, check_integers, register_allocator, register_scorer, top_indices
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.signals.continuation import PassDone, causal_attention_rows, probe_tokens

REREAD = "kvcompose reread"  # the second reading's phase in `engine.timings`
REDUCTIONS = ("max", "mean")
ROUNDINGS = ("exact", "kvpress")
PIECE = 512  # tokens per forward of the second reading


def reread_attention(state, piece: int = PIECE) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, mean) [L, H_q, n] float32 over the second reading's queries of the attention each prompt entry gets
    (once per prefill)."""
    return state.memo((reread_attention, piece), lambda: _reread(state, piece))


def _reread(state, piece: int):
    if state.model is None:
        raise UserError("kvcompose needs the model to read the prompt a second time: prefill with the model")
    layers, length = state.num_layers, state.length
    heads = state.num_query_heads
    best = torch.zeros(layers, heads, length, device=state.device)
    total = torch.zeros(layers, heads, length, device=state.device)

    def reduce(layer, query, new_keys):
        for _, block in causal_attention_rows(query, state.keys[layer], new_keys, state.scaling):
            block = block.flatten(0, 1)  # [H_q, rows, n]
            torch.maximum(best[layer], block.amax(1), out=best[layer])
            total[layer] += block.sum(1)
        if layer == layers - 1:
            raise PassDone  # what follows the last layer's attention feeds no score

    with timings.phase(REREAD):
        probe_tokens(state.model, state, state.input_ids.tolist(), reduce, piece=piece)
    return best, total / length


def reread_scores(state, layer: int, agg_task: str, agg_group: str, add_v_norm: int, add_mean_across_heads: int):
    """KVCompose's scores [H_kv, n] of every entry of `layer` (see the module docstring)."""
    best, mean = reread_attention(state)
    grouped = (best if agg_task == "max" else mean)[layer].view(state.num_kv_heads, -1, state.length)
    scores = grouped.amax(1) if agg_group == "max" else grouped.mean(1)
    if add_v_norm:
        scores = scores * state.values[layer].float().norm(dim=-1)
    if add_mean_across_heads:
        scores = scores + scores.mean(0, keepdim=True)
    return scores


def check_reduction(name: str, value: str) -> None:
    if value not in REDUCTIONS:
        raise UserError(f"option {name} must be one of {', '.join(REDUCTIONS)}, got {value!r}")


@register_scorer("kvcompose")
@dataclass(frozen=True)
class KVComposeScorer(PromptScorer):
    agg_task: str = "max"
    agg_group: str = "mean"
    add_v_norm: int = 0
    add_mean_across_heads: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_reduction("agg_task", self.agg_task)
        check_reduction("agg_group", self.agg_group)
        for name in ("add_v_norm", "add_mean_across_heads"):
            if getattr(self, name) not in (0, 1):
                raise UserError(f"option {name} must be 0 or 1, got {getattr(self, name)!r}")

    def every(self, state, layer):
        options = (self.agg_task, self.agg_group, self.add_v_norm, self.add_mean_across_heads)
        return state.memo((reread_scores, layer, *options), lambda: reread_scores(state, layer, *options))


@register_allocator("kvcompose")
@dataclass(frozen=True)
class CompositeBudgets(Allocator):
    agg_head: str = "mean"
    keep_token_lower_bound: int = 0
    rounding: str = "exact"
    prompt_dependent = True
    prompt_note = ("its per-layer counts come from ranking every layer's composite tokens together, recorded per "
                   "sample by `ripplekv eval`")

    def __post_init__(self):
        super().__post_init__()
        check_reduction("agg_head", self.agg_head)
        check_integers({"keep_token_lower_bound": self.keep_token_lower_bound}, minimum=0)
        if self.rounding not in ROUNDINGS:
            raise UserError(f"option rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"kvcompose budgets depend on each prompt's scores; {self.prompt_note}")

    def composites(self, state, scorer, floor: int) -> torch.Tensor:
        """[L, m]: each layer's composite tokens beyond its floor (heads' sorted scores reduced rank by rank)."""
        rows = []
        for layer in range(state.num_layers):
            ranked = torch.sort(scorer.scores(state, layer).float(), dim=-1, descending=True).values
            composite = ranked.amax(0) if self.agg_head == "max" else ranked.mean(0)
            composite[: self.keep_token_lower_bound] += 1e9
            rows.append(composite)
        composites = torch.stack(rows)
        composites[0] = composites.amax(0)  # layer 0 never gets less than another layer
        scored = composites.shape[1]
        return composites[:, max(floor - (state.length - scored), 0):]  # a floor reaching into the scored part

    def prompt_budgets(self, state, budget, scorer):
        check_budget(budget)
        layers, length = state.num_layers, state.length
        if length <= budget:
            return [length] * layers
        if self.rounding == "kvpress":
            composites = self.composites(state, scorer, 0)
            window = min(length - composites.shape[1], budget)  # the scorer's window, kept unscored (0 for kvpress)
            return kvpress_counts(composites, budget, window, max(1, self.keep_token_lower_bound), length)
        floor = min(max(scorer.floor(), self.keep_token_lower_bound, 1), budget)
        composites = self.composites(state, scorer, floor)
        spare = layers * (budget - floor)
        chosen = top_indices(composites.reshape(-1), min(spare, composites.numel()))
        won = np.bincount((chosen // composites.shape[1]).cpu().numpy(), minlength=layers)
        return integer_budgets([floor + int(w) for w in won], budget, length, floor)


def kvpress_counts(composites: torch.Tensor, budget: int, window: int, least: int, length: int) -> list[int]:
    """`KVComposePress`'s per-layer counts (`rounding=kvpress`): the top L x (B - window) of every layer's composite
    tokens [L, m] together, then each layer raised to `least` (its max(1, keep_token_lower_bound)). A layer that won
    fewer keeps that many all the same, so the total can pass L x B: the drift the exact reading removes."""
    layers = composites.shape[0]
    chosen = top_indices(composites.reshape(-1), min(layers * (budget - window), composites.numel()))
    won = np.bincount((chosen // composites.shape[1]).cpu().numpy(), minlength=layers)
    return [min(max(window + int(w), least), length) for w in won]
