"""GraceKV (our reading): prototype trees of every (layer, KV head, slot) compete for one global budget.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.engine import adapter, entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.errors import UserError
from ripplekv.methods.base import check_integers, check_positive, options_of
from ripplekv.methods.budgets import check_budget
from ripplekv.methods.snapkv import window_scores

TINY = 1e-30  # keeps relative errors finite where a node's true attention underflows to zero
LARGE = 1e6


@dataclass(frozen=True)
class GraceKVOptions:
    """GraceKV's options (the fields a spec such as `gracekv:slot=32` sets)."""

    window: int = 32
    sinks: int = 4
    slot: int = 64
    singletons: float = 0.2
    beta: float = 0.1

    def __post_init__(self):
        check_positive(window=self.window, slot=self.slot)
        check_integers({"sinks": self.sinks}, minimum=0)
        if self.slot & (self.slot - 1):
            raise UserError(f"option slot must be a power of two (a binary tree per slot), got {self.slot}")
        if not 0 <= self.singletons <= 1:
            raise UserError(f"option singletons must be a share in [0, 1], got {self.singletons!r}")
        if not self.beta >= 0:
            raise UserError(f"option beta must be >= 0, got {self.beta!r}")


@dataclass(frozen=True)
class GraceKV:
    """The GraceKV method (a `Method`): budgets and entries come from one global greedy over prototype trees,
    so it is not an allocator x scorer; `budgets` and `compress` share one build per (prompt, budget)."""

    label: str
    preset: str
    options: GraceKVOptions

    Options = GraceKVOptions  # what a spec's options build (methods.presets)
    is_full = False
    prompt_dependent = True
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


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Where the entries of every (layer, head) come from at one budget (the same for all of them)."""

    length: int
    window: int  # last tokens kept exactly
    sinks: int  # first tokens kept exactly
    singles: int  # top-R compressible tokens kept exactly, per head
    remaining: int  # M: compressible tokens left for the trees
    slots: int  # per (layer, head)
    slot: int  # padded slot size (a power of two)
    actions: int  # entries the greedy spends, over all (layer, head, slot)

    @property
    def depth(self) -> int:
        return self.slot.bit_length() - 1

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(has, token): padded position p holds remaining token `token[p]` when `has[p]`.

        The M tokens are spread over slots x slot positions with floor(p M / P) boundaries, so every level
        of the trees is a reshape of this one layout, slots differ by at most one token, and a node of two
        or more tokens always splits into two non-empty children.
        """
        total = self.slots * self.slot
        p = torch.arange(total + 1)
        cum = torch.div(p * self.remaining, total, rounding_mode="floor")
        return cum[1:] > cum[:-1], cum[:-1].clamp(max=max(self.remaining - 1, 0))


def layout(length: int, budget: int, opts: GraceKVOptions, num_units: int) -> Layout | None:
    """The split of a budget B < n into exact tokens and tree actions; None when B < sinks + window."""
    window = min(opts.window, length)
    sinks = min(opts.sinks, length - window)
    spare = budget - window - sinks
    if spare < 0:
        return None
    singles = math.floor(opts.singletons * spare)
    remaining = length - window - sinks - singles
    slots = -(-remaining // opts.slot)
    return Layout(length, window, sinks, singles, remaining, slots, opts.slot, num_units * (spare - singles))


# --------------------------------------------------------------------------- prototypes


@dataclass
class Nodes:
    """Every node of one tree level for all heads of a layer: [H, S] (and [H, S, d])."""

    count: torch.Tensor  # [S] tokens per node (float)
    keys: torch.Tensor  # [H, S, d] prototype keys (post-RoPE), exact key for one token
    values: torch.Tensor
    log_weights: torch.Tensor  # [H, S] log m_eff
    positions: torch.Tensor  # [H, S] long, rounded mean position
    relevance: torch.Tensor  # [H, S] R summed over the node


class RopeTable:
    """The model's RoPE (cos, sin) at every prompt position, computed once and looked up by index."""

    def __init__(self, model, length: int, like: torch.Tensor):
        self.cos, self.sin = adapter.rope_at(model, torch.arange(max(length, 1), device=like.device), like)

    def at(self, positions: torch.Tensor):
        return self.cos[positions], self.sin[positions]


def unrotate(rope: RopeTable, keys, positions):
    """Keys as they were before RoPE (position 0): the inverse rotation at each key's own position."""
    return adapter.invert_rope(keys, *rope.at(positions))


@dataclass
class Sums:
    """Per-node sums over the real tokens of one tree level: a parent's sums are its two children's."""

    count: torch.Tensor  # [S]
    keys: torch.Tensor  # [H, S, d]
    unrotated: torch.Tensor  # [H, S, d] keys before RoPE
    norms: torch.Tensor  # [H, S] of the un-rotated keys
    positions: torch.Tensor  # [H, S]
    relevance: torch.Tensor  # [H, S]
    values: torch.Tensor  # [H, S, d]
    weighted_values: torch.Tensor  # [H, S, d] relevance x value

    @classmethod
    def of_tokens(cls, keys, unrotated, values, positions, relevance, has) -> Sums:
        real = has.to(keys.dtype)
        rel = relevance * real
        return cls(real, keys * real[:, None], unrotated * real[:, None], unrotated.norm(dim=-1) * real,
                   positions.to(keys.dtype) * real, rel, values * real[:, None], rel[..., None] * values)

    def group(self, size: int) -> Sums:
        """Sums over consecutive groups of `size` nodes (2: the level above)."""

        def seg(x):
            return x.reshape(*x.shape[:-2], -1, size, x.shape[-1]).sum(-2) if x.dim() == 3 else \
                x.reshape(*x.shape[:-1], -1, size).sum(-1)

        return Sums(self.count.reshape(-1, size).sum(-1), *(seg(getattr(self, name)) for name in (
            "keys", "unrotated", "norms", "positions", "relevance", "values", "weighted_values")))


def prototypes(rope: RopeTable, sums: Sums, beta: float) -> Nodes:
    """Each node's prototype (a node of one token is that token, exactly)."""
    count = sums.count
    many = count > 1
    if not bool(many.any()):
        zeros = torch.zeros_like(sums.relevance)
        return Nodes(count, sums.keys, sums.values, zeros, sums.positions.round().long(), sums.relevance)
    safe = count.clamp(min=1)
    mean_key = sums.unrotated / safe[:, None]
    coherence = mean_key.norm(dim=-1) / (sums.norms / safe).clamp(min=TINY)
    m_eff = torch.minimum(torch.maximum(count * coherence**2, torch.ones_like(coherence)), count.expand_as(coherence))
    mean_position = torch.round(sums.positions / safe).long()
    proto_keys = adapter.apply_rope(mean_key, *rope.at(mean_position))
    shift = beta * sums.relevance / safe  # weights R + beta, beta = beta x mean R over the node
    weight = sums.relevance + shift * count
    weighted = (sums.weighted_values + shift[..., None] * sums.values) / weight.clamp(min=TINY)[..., None]
    proto_values = torch.where((weight > 0)[..., None], weighted, sums.values / safe[:, None])
    exact = (~many)[None, :, None]
    return Nodes(
        count=count,
        keys=torch.where(exact, sums.keys, proto_keys),
        values=torch.where(exact, sums.values, proto_values),
        log_weights=torch.where(many[None], torch.log(m_eff.clamp(min=1)), torch.zeros_like(m_eff)),
        positions=mean_position,
        relevance=sums.relevance,
    )


def summarize(rope, keys, unrotated, values, positions, relevance, has, size: int, beta: float) -> Nodes:
    """Prototypes of consecutive groups of `size` padded entries ([H, P, d] tensors; `has` [P] marks real ones)."""
    return prototypes(rope, Sums.of_tokens(keys, unrotated, values, positions, relevance, has).group(size), beta)


def distortion(nodes: Nodes, queries, shift, scaling, attn, values, size: int) -> torch.Tensor:
    """D [H, S]: mean over window queries of the relative mass and value-sum errors of each prototype.

    `attn` [H, P, Q] are the queries' ([H, Q, d]) exp-logits at the padded tokens (0 on padding), each
    query's logits less its `shift` [H, 1, Q]; the prototypes' logits are shifted alike.
    """
    heads, total, rows = attn.shape
    groups = total // size
    blocks = attn.reshape(heads, groups, size, rows)  # [H, S, z, Q]
    grouped_values = values.reshape(heads, groups, size, -1)  # [H, S, z, d]
    true_mass = blocks.sum(2)  # [H, S, Q]
    proto_mass = torch.matmul(nodes.keys, queries.transpose(-1, -2)).mul_(scaling).sub_(shift)
    proto_mass = proto_mass.add_(nodes.log_weights[..., None]).exp_()  # [H, S, Q]
    error = (proto_mass - true_mass).abs_().div_(true_mass.clamp_(min=TINY)).clamp_(max=LARGE)
    # |m v - T|^2 = m^2 |v|^2 - 2 m v.T + |T|^2 with T = sum_j a_j v_j, through the slot's Gram matrix
    # (never materializing T per query and node: [H, S, Q, d] would be tens of MB per level).
    gram = torch.matmul(grouped_values, grouped_values.transpose(-1, -2))  # [H, S, z, z]
    true_norm2 = torch.matmul(gram, blocks).mul_(blocks).sum(2).clamp_(min=0)
    along = torch.matmul(grouped_values, nodes.values[..., None])  # [H, S, z, 1]: v_j . prototype value
    cross = torch.matmul(along.transpose(-1, -2), blocks)[:, :, 0]  # [H, S, Q]
    error2 = proto_mass.square().mul_((nodes.values**2).sum(-1, keepdim=True)).sub_(cross.mul_(proto_mass).mul_(2))
    sum_error = error2.add_(true_norm2).clamp_(min=0).sqrt_().div_(true_norm2.sqrt_().clamp_(min=TINY))
    # Capped so an underflowed true attention (and so R ~ 0) never makes E = R x D a NaN.
    error = error.add_(sum_error.clamp_(max=LARGE)).mean(-1).mul_(0.5)
    return torch.where(nodes.count[None] > 1, error, torch.zeros_like(error))


# --------------------------------------------------------------------------- one layer


@dataclass
class LayerTrees:
    padded_keys: torch.Tensor  # [H, P, d] the remaining tokens in the padded layout
    unrotated: torch.Tensor  # [H, P, d] their keys before RoPE
    padded_values: torch.Tensor
    positions: torch.Tensor  # [H, P] long
    relevance: torch.Tensor  # [H, P]
    singles: torch.Tensor  # [H, f] positions of the exact top-R tokens
    has: torch.Tensor  # [P] bool: a padded position holds a token

    def levels(self, rope: RopeTable, beta: float, depth: int, tokens: bool = True) -> list[Nodes]:
        """Prototypes of every tree level, root level first (`depth` levels, + the tokens' level if `tokens`)."""
        sums = [Sums.of_tokens(self.padded_keys, self.unrotated, self.padded_values, self.positions, self.relevance,
                               self.has)]
        for _ in range(depth):
            sums.append(sums[-1].group(2))
        return [prototypes(rope, level, beta) for level in reversed(sums[0 if tokens else 1 :])]


def layer_trees(state: PrefillState, layer: int, plan: Layout, rope: RopeTable) -> LayerTrees:
    """Singletons out, the rest of the compressible tokens of every head in the padded layout."""
    keys, values = state.keys[layer].float(), state.values[layer].float()
    relevance = window_scores(state, layer, plan.window, 1, "none")[:, plan.sinks :]  # [H, n_c]
    heads, compressible = relevance.shape
    singles = torch.topk(relevance, plan.singles, dim=-1).indices if plan.singles else relevance[:, :0].long()
    chosen = torch.zeros(heads, compressible, dtype=torch.bool, device=relevance.device)
    chosen.scatter_(1, singles, True)
    rest = torch.argsort(chosen.to(torch.int8), dim=-1, stable=True)[:, : plan.remaining]  # ascending positions
    has, token = plan.padded()
    index = rest[:, token.to(rest.device)]  # [H, P]
    positions = index + plan.sinks
    rows = torch.arange(heads, device=keys.device)[:, None]
    padded_keys = keys[rows, positions]
    return LayerTrees(padded_keys, unrotate(rope, padded_keys, positions), values[rows, positions], positions,
                      relevance[rows, index], torch.sort(singles, dim=-1).values + plan.sinks, has.to(keys.device))


def layer_gains(state: PrefillState, layer: int, plan: Layout, opts: GraceKVOptions, rope: RopeTable) -> list[torch.Tensor]:
    """Action priorities of one layer: [add roots [H, slots], split level 0 [H, slots], split level k [H, slots 2^k]...]."""
    trees = layer_trees(state, layer, plan, rope)
    has = trees.has
    heads = state.num_kv_heads
    queries = state.window_queries[layer][:, -plan.window :].float()
    queries = queries.reshape(heads, -1, queries.shape[-1])  # [H, g*w, d]: the query heads of a KV head
    logits = torch.matmul(trees.padded_keys, queries.transpose(-1, -2)) * state.scaling  # [H, P, Q]
    logits = logits.masked_fill(~has[:, None], float("-inf"))
    top = logits.amax(1, keepdim=True)  # per-query shift: relative errors do not depend on it
    attn = torch.exp(logits - top)
    costs, counts, relevance = [], [], []  # E = R x D per node, for the inner levels (tokens have E = 0)
    for level, nodes in enumerate(trees.levels(rope, opts.beta, plan.depth, tokens=False)):
        error = distortion(nodes, queries, top, state.scaling, attn, trees.padded_values, plan.slot >> level)
        costs.append(nodes.relevance * error)
        counts.append(nodes.count)
        relevance.append(nodes.relevance)
    costs.append(torch.zeros(heads, plan.slots * plan.slot, device=state.device))
    splits = [
        (costs[level] - costs[level + 1].reshape(heads, -1, 2).sum(-1)).masked_fill(counts[level][None] < 2, float("-inf"))
        for level in range(plan.depth)
    ]
    roots = relevance[0] if relevance else trees.relevance * trees.has  # slot = 1: every root is one token
    return [roots - costs[0], *splits]  # add gain: R x D_drop (= 1) - E(root)


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


def build(state: PrefillState, budget: int, opts: GraceKVOptions) -> Build:
    """GraceKV's entries for one prompt and budget, computed once and kept in `state.scores`."""
    check_budget(budget)
    key = ("gracekv", opts, budget)
    if key not in state.scores:
        state.scores[key] = _build(state, budget, opts)
    return state.scores[key]


def _build(state: PrefillState, budget: int, opts: GraceKVOptions) -> Build:
    layers, heads, n = state.num_layers, state.num_kv_heads, state.length
    if n <= budget:
        return Build(np.full((layers, heads), n, dtype=np.int64), [state.full_entries(l) for l in range(layers)])
    plan = layout(n, budget, opts, layers * heads)
    if plan is None:  # B < sinks + window: the window's last entries, then the first sinks
        mask = torch.zeros(heads, n, dtype=torch.bool, device=state.device)
        window = min(opts.window, budget)
        mask[:, n - window :] = True
        mask[:, : budget - window] = True
        built = [entries.gather(state.keys[l], state.values[l], mask) for l in range(layers)]
        return Build(np.full((layers, heads), budget, dtype=np.int64), built)
    if state.model is None:
        raise UserError("gracekv needs the model's RoPE: build its entries from a prefill of the model")
    rope = RopeTable(state.model, n, state.keys[0].float())
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
    return Build(counts, built)


def layer_entries(state, layer: int, plan: Layout, opts: GraceKVOptions, rope: RopeTable,
                  chosen: list[torch.Tensor]) -> entries.LayerEntries:
    """Sinks, singletons, the tree nodes that are present and not split, and the window, in position order."""
    trees = layer_trees(state, layer, plan, rope)
    keys, values = state.keys[layer], state.values[layer]
    heads, n = keys.shape[0], keys.shape[1]
    exact = torch.cat([
        torch.arange(plan.sinks, device=keys.device).expand(heads, -1),
        trees.singles,
        torch.arange(n - plan.window, n, device=keys.device).expand(heads, -1),
    ], dim=1)
    rows = torch.arange(heads, device=keys.device)[:, None]
    parts_k, parts_v = [keys[rows, exact].float()], [values[rows, exact].float()]
    parts_w, parts_p = [torch.zeros(exact.shape, device=keys.device)], [exact]
    parts_keep = [torch.ones(exact.shape, dtype=torch.bool, device=keys.device)]
    present = chosen[0]  # roots added
    for level, nodes in enumerate(trees.levels(rope, opts.beta, plan.depth)):
        split = chosen[level + 1] if level < plan.depth else torch.zeros_like(present)
        parts_k.append(nodes.keys)
        parts_v.append(nodes.values)
        parts_w.append(nodes.log_weights)
        parts_p.append(nodes.positions)
        parts_keep.append(present & ~split)
        present = split.repeat_interleave(2, dim=1)
    keep = torch.cat(parts_keep, 1)
    positions = torch.cat(parts_p, 1)
    counts = keep.sum(-1)
    longest = int(counts.max())
    order = torch.argsort(torch.where(keep, positions, n), dim=-1, stable=True)[:, :longest]
    valid = torch.arange(longest, device=keys.device)[None, :] < counts[:, None]
    return entries.LayerEntries(
        keys=torch.cat(parts_k, 1)[rows, order].to(keys.dtype),
        values=torch.cat(parts_v, 1)[rows, order].to(values.dtype),
        positions=positions.gather(1, order).masked_fill(~valid, -1),
        counts=counts,
        log_weights=torch.cat(parts_w, 1).gather(1, order).masked_fill(~valid, 0.0).float(),
    )
