"""GraceKV: prototype trees of every (layer, KV head, slot) compete for one global budget.

Two forms share this Method. The default (`slots=curvature`) is the published one, built in
`methods.gracekv.published` (slots from `slots`, relevance and head weights from `signals`, trees
with two split kinds from `split`). `slots=fixed` is our earlier reading, described below and built
here with `methods.gracekv.trees`:

The compressible prompt of each (layer, KV head) (all but `sinks` first tokens and the `window` last ones)
loses its `singletons` share of exact top-scored tokens first; the rest is cut into slots of at most
`slot` tokens. Each slot is a binary tree by bisection: leaves are tokens, an inner node is one prototype
of its interval. A global greedy spends the entries left: *add a slot's root* or *split a present node*
into its two children, each costing one entry, highest gain first. Gains are relevance-weighted
distortions: E(node) = R(node) x D(node), R the window's SnapKV attention to the node's tokens (un-pooled,
mean over the query heads of a KV head), D the node's prototype error on the window queries (below); a
slot with nothing kept loses all of its attention (D_drop = 1). add gain = R x D_drop - E(root); split
gain = E(node) - E(left) - E(right) (children's distortions weighted by their own relevance).

Prototype of m tokens: key = the mean of the un-rotated keys (inverse RoPE at each own position),
re-rotated at the rounded mean position; value = mean of values weighted by R + beta x mean R; log-weight
log m_eff, m_eff = clamp(m h^2, 1, m), h = |mean un-rotated key| / mean |un-rotated key|. D = mean over
window queries of (relative error of the attention mass + relative error of the attention-weighted value
sum) / 2 when the node's tokens are replaced by the prototype; D(token) = 0.

The greedy is one max-heap in principle; we compute its exact order without a Python heap (see
`greedy_order`). Totals are exact: sinks + window + singletons + one entry per action = L x H_kv x B.

The trees, their prototypes and gains live in `methods.gracekv.trees`; this module holds the Method, the
global greedy and the entries it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.engine import entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.base import options_of
from ripplekv.methods.core.budgets import check_budget
from ripplekv.methods.core.registry import register_method_class
from ripplekv.methods.gracekv import published
from ripplekv.methods.gracekv.trees import (
    GraceKVOptions,
    Layout,
    RopeTable,
    Sums,
    layer_gains,
    layer_trees,
    layout,
    prototypes,
)


@register_method_class("gracekv")
@dataclass(frozen=True)
class GraceKV:
    """The GraceKV method (a `Method`): budgets and entries come from one global greedy over prototype trees,
    so it is not an allocator x scorer; `budgets` and `compress` share one build per (prompt, budget)."""

    label: str
    preset: str
    options: GraceKVOptions

    Options = GraceKVOptions  # what a spec's options build (methods.core.spec)
    is_full = False
    prompt_dependent = True
    knows_answer = False
    sliding_layers = False  # its global greedy spans the whole prompt in every layer: no sliding-window layers yet
    prompt_note = ("its per-layer and per-head counts are what its prototype trees win on each prompt, "
                   "recorded per sample by `ripplekv eval`")

    @property
    def name(self) -> str:
        return self.label

    def describe(self) -> dict:
        """In the allocator/scorer layout of every method's config entry, so runs written before still resume."""
        return {"preset": self.preset, "allocator": {"name": "gracekv"},
                "scorer": {"name": "gracekv", **options_of(self.options)}}

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.options.window)  # relevance and distortion use the window's queries

    def degenerate(self, budget: int) -> str | None:
        return None  # window and sinks are capped by the budget inside the global greedy

    def layer_budgets(self, num_layers, budget, length):
        raise UserError(f"gracekv splits budgets by the prompt's scores; {self.prompt_note}")

    def budgets(self, state, budget):
        return build(state, budget, self.options).counts

    def compress(self, state, budget):
        return build(state, budget, self.options).entries

    def build_notes(self, state, budget) -> dict | None:
        """What the build for this prompt and budget did: slots, floor and splits of each kind (None when
        nothing was merged: B >= n or B below sinks + window)."""
        return build(state, budget, self.options).notes

# --------------------------------------------------------------------------- the global greedy


def greedy_order(levels: list[torch.Tensor]) -> torch.Tensor:
    """The order in which one global max-heap pops the actions of a forest of identical action trees.

    `levels[a]` [U, n_a] are the priorities of action level a of U trees; the parent of (a, i) is
    (a - 1, i // 2) for a >= 2 and (0, 0) for a = 1 (a slot's split of its root follows its add). Returns
    flat indices into the concatenation of the flattened levels, in pop order.

    Why a sort gives the heap's order: a node can only be popped after its parent, and once a node x
    is popped, its descendants whose whole path below x beats x's priority are popped right after
    (everything else available is no better than x). So the pop order sorts nodes by the minimum
    priority on their root path, then, among nodes sharing that minimum at the same ancestor, by the
    minimum on the rest of the path below it, and so on: a lexicographic key of at most depth + 1
    path minima, padded with +inf so an ancestor precedes its descendants. Ties keep ancestors first.
    """
    depth = len(levels)
    keys_by_level = []
    for a, level in enumerate(levels):
        width = level.shape[1]
        index = torch.arange(width, device=level.device)
        path = torch.stack([levels[j][:, index >> (a - j)] if j else levels[0][:, :1].expand(-1, width)
                            for j in range(a + 1)], dim=-1)  # [U, n_a, a + 1]
        steps = torch.arange(a + 1, device=level.device)
        start = torch.zeros(path.shape[:2], dtype=torch.long, device=level.device)
        components = []
        for _ in range(depth):
            rest = path.masked_fill(steps < start[..., None], float("inf"))
            value, where = rest.min(-1)
            done = start > a
            components.append(value.masked_fill(done, float("inf")))
            start = torch.where(done, start, where + 1)
        keys_by_level.append(torch.stack(components, -1).reshape(-1, depth))
    keys = torch.cat(keys_by_level)  # [N, depth]
    order = torch.arange(keys.shape[0], device=keys.device)
    for component in reversed(range(depth)):
        step = torch.sort(keys[order, component], descending=True, stable=True).indices
        order = order[step]
    return order


# --------------------------------------------------------------------------- the build


@dataclass
class Build:
    counts: np.ndarray  # [L, H_kv] entries per (layer, head)
    entries: list[entries.LayerEntries]
    notes: dict | None = None  # what the build did (slots, floor, splits of each kind), for `ripplekv inspect`


def build(state: PrefillState, budget: int, opts: GraceKVOptions) -> Build:
    """GraceKV's entries for one prompt and budget, computed once per prefill (`PrefillState.memo`)."""
    check_budget(budget)
    return state.memo((build, opts, budget), lambda: _build(state, budget, opts))


def _build(state: PrefillState, budget: int, opts: GraceKVOptions) -> Build:
    layers, heads, n = state.num_layers, state.num_kv_heads, state.length
    if state.hybrid:
        raise UserError("gracekv does not support models with sliding-window layers yet (its prototypes span the "
                        "whole prompt in every layer): drop it from {methods} for this model", "methods")
    free = min(opts.window, n) + min(opts.sinks, n - min(opts.window, n)) if opts.ends == "free" else 0
    if n <= budget + free:  # under ends=free, sinks and window beside the budget
        return Build(np.full((layers, heads), n, dtype=np.int64), [state.full_entries(l) for l in range(layers)])
    plan = layout(n, budget, opts, layers * heads)
    if plan is None and opts.ends == "charged":  # B < sinks + window: the window's last entries, then the first sinks
        mask = torch.zeros(heads, n, dtype=torch.bool, device=state.device)
        window = min(opts.window, budget)
        mask[:, n - window :] = True
        mask[:, : budget - window] = True
        built = [entries.gather(state.keys[l], state.values[l], mask) for l in range(layers)]
        return Build(np.full((layers, heads), budget, dtype=np.int64), built)
    if state.model is None:
        raise UserError("gracekv needs the model's RoPE: build its entries from a prefill of the model")
    rope = RopeTable(state.model, n, state.keys[0].float())
    if opts.slots == "curvature":
        window = min(opts.window, n)
        counts, built, notes = published.build(state, budget, opts, rope, min(opts.sinks, n - window), window)
        return Build(counts, built, notes)
    gains = [layer_gains(state, layer, plan, opts, rope) for layer in range(layers)]
    levels = [torch.stack([g[a] for g in gains]).reshape(layers * heads * plan.slots, -1) for a in range(len(gains[0]))]
    order = greedy_order(levels)[: plan.actions]
    sizes = [level.numel() for level in levels]
    picked = torch.zeros(sum(sizes), dtype=torch.bool, device=order.device)
    picked[order] = True
    chosen = [part.reshape(layers, heads, -1) for part in torch.split(picked, sizes)]  # [L, H, slots x 2^k]
    wins = sum(part.sum(-1) for part in chosen)
    counts = (wins + plan.window + plan.sinks + plan.singles).cpu().numpy().astype(np.int64)
    built = [layer_entries(state, layer, plan, opts, rope, [part[layer] for part in chosen]) for layer in range(layers)]
    return Build(counts, built, {"slots": plan.slots, "slot_lengths": [plan.slot] * 3, "floor": plan.singles * layers * heads,
                                 "roots_added": int(chosen[0].sum()),
                                 "splits": {"bisect": int(sum(part.sum() for part in chosen[1:])), "pull": 0, "middle": 0}})


def layer_entries(state, layer: int, plan: Layout, opts: GraceKVOptions, rope: RopeTable,
                  chosen: list[torch.Tensor]) -> entries.LayerEntries:
    """Sinks, singletons, the tree nodes that are present and not split, and the window, in position order.

    Prototypes are computed for the nodes that end up in the entries only (a prototype depends on its
    node's sums alone): every candidate's sums are laid side by side and the kept ones taken by position.
    """
    trees = layer_trees(state, layer, plan, rope)
    keys, values = state.keys[layer], state.values[layer]
    heads, n = keys.shape[0], keys.shape[1]
    exact = torch.cat([
        torch.arange(plan.sinks, device=keys.device).expand(heads, -1),
        trees.singles,
        torch.arange(n - plan.window, n, device=keys.device).expand(heads, -1),
    ], dim=1)
    rows = torch.arange(heads, device=keys.device)[:, None]
    exact_keys, exact_values = keys[rows, exact].float(), values[rows, exact].float()
    zeros = torch.zeros(exact.shape, device=keys.device)
    parts = [Sums(torch.ones(exact.shape, device=keys.device), exact_keys, exact_keys, zeros, exact.to(zeros.dtype),
                  zeros, exact_values, exact_values)]  # one-token nodes: their prototype is the token itself
    parts_keep = [torch.ones(exact.shape, dtype=torch.bool, device=keys.device)]
    present = chosen[0]  # roots added
    for level, sums in enumerate(trees.sums(plan.depth)):
        split = chosen[level + 1] if level < plan.depth else torch.zeros_like(present)
        parts.append(sums)
        parts_keep.append(present & ~split)
        present = split.repeat_interleave(2, dim=1)
    keep = torch.cat(parts_keep, 1)
    candidates = Sums.cat(parts)
    positions = torch.round(candidates.positions / candidates.count.clamp(min=1)).long()  # as `prototypes` rounds
    counts = keep.sum(-1)
    longest = int(counts.max())
    order = torch.argsort(torch.where(keep, positions, n), dim=-1, stable=True)[:, :longest]
    nodes = prototypes(rope, candidates.take(order), opts.beta)
    valid = torch.arange(longest, device=keys.device)[None, :] < counts[:, None]
    return entries.LayerEntries(
        keys=nodes.keys.to(keys.dtype),
        values=nodes.values.to(values.dtype),
        positions=positions.gather(1, order).masked_fill(~valid, -1),
        counts=counts,
        log_weights=nodes.log_weights.masked_fill(~valid, 0.0).float(),
    )
