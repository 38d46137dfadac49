"""GraceKV's prototype trees and their gains: the options and per-budget layout that shape the trees, the
prototypes of every tree level with their distortions, and one layer's action gains.

Every (layer, KV head) cuts its compressible prompt into slots, each a binary tree by bisection whose inner
nodes are prototypes of their intervals (see `methods.gracekv` for the method as a whole). This module
builds those trees and prices each action (add a slot's root, split a node); the global greedy that
spends the budget on them, and the entries it keeps, are in `methods.gracekv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ripplekv.engine import adapter
from ripplekv.engine.prefill import PrefillState
from ripplekv.errors import UserError
from ripplekv.methods.core.base import check_integers, check_positive, top_indices
from ripplekv.methods.snapkv import window_scores

TINY = 1e-30  # keeps relative errors finite where a node's true attention underflows to zero
LARGE = 1e6


@dataclass(frozen=True)
class GraceKVOptions:
    """GraceKV's options (the fields a spec such as `gracekv:slot=32` sets).

    `slots`: "curvature" (the published form: slots cut by a dynamic program over boundary scores, relevance
    with propagation, head weights, two split kinds) or "fixed" (our earlier reading: `slot`-token spans,
    bisection only). Every value below that the paper's transcription does not give is ours: `min_slot`,
    `max_slot` and the target `slot` are the paper's 16..128 and 64; `shape` (the DP's penalty on a slot's
    relative distance from the target), `widths` (the curvature windows w), `spread` (lambda: mean minus
    lambda x std over layers and windows), `mix` (weight of the propagated relevance), `seeds`, `hops`,
    `singletons` (the floor's share of the spare budget) and `depth` (levels whose splits are priced by
    distortion; deeper ones bisect at the middle and pop after every priced action) are our choices.
    shape=4 centres slots near the target on the bundled model (median 51 tokens on a 3.5k-token niah
    prompt; shape=1 let the boundary rewards cut median-22 slots); depth=10 keeps the build near a quarter
    to a half of a prefill there; neither is tuned for accuracy.
    `ends`: "charged" (default) counts sinks and window in the budget, so every method keeps exactly
    L x H_kv x B entries; "free" keeps them beside the budget as the paper does, which lets GraceKV keep
    more entries than the methods it is compared with (for comparison with the paper only).
    """

    window: int = 32
    sinks: int = 4
    slot: int = 64
    singletons: float = 0.2
    beta: float = 0.1
    slots: str = "curvature"
    min_slot: int = 16
    max_slot: int = 128
    shape: float = 4.0
    widths: tuple[float, ...] = (2.0, 4.0, 8.0)
    spread: float = 0.5
    mix: float = 0.5
    seeds: int = 8
    hops: int = 1
    depth: int = 10
    ends: str = "charged"

    def __post_init__(self):
        check_positive(window=self.window, slot=self.slot, min_slot=self.min_slot, max_slot=self.max_slot,
                       seeds=self.seeds, depth=self.depth)
        check_integers({"sinks": self.sinks, "hops": self.hops}, minimum=0)
        if self.slots not in ("curvature", "fixed"):
            raise UserError(f"option slots must be curvature or fixed, got {self.slots!r}")
        if self.ends not in ("charged", "free"):
            raise UserError(f"option ends must be charged or free, got {self.ends!r}")
        if self.slots == "fixed" and self.ends == "free":
            raise UserError("option ends=free needs slots=curvature (the fixed-slot reading charges every entry)")
        if self.slots == "fixed" and self.slot & (self.slot - 1):
            raise UserError(f"option slot must be a power of two (a binary tree per slot), got {self.slot}")
        curved = self.slots == "curvature"
        if curved and (not self.min_slot <= self.slot <= self.max_slot or self.max_slot < 2 * self.min_slot - 1):
            raise UserError(f"options need min_slot <= slot <= max_slot and max_slot >= 2 x min_slot - 1 (so every "
                            f"length >= min_slot can be cut), got {self.min_slot}, {self.slot}, {self.max_slot}")
        if not self.widths or any(w < 1 or w != int(w) for w in self.widths):
            raise UserError(f"option widths must be positive integers separated by /, got {self.widths!r}")
        if not 0 <= self.singletons <= 1:
            raise UserError(f"option singletons must be a share in [0, 1], got {self.singletons!r}")
        for name in ("beta", "shape", "spread", "mix"):
            if not getattr(self, name) >= 0:
                raise UserError(f"option {name} must be >= 0, got {getattr(self, name)!r}")

    def unused_options(self) -> dict[str, str]:
        """With slots=fixed, the options of the published form's curvature cut, relevance and splits do nothing."""
        if self.slots != "fixed":
            return {}
        why = "used by slots=curvature only; slots=fixed bisects fixed slots"
        return {name: why for name in ("min_slot", "max_slot", "shape", "widths", "spread", "mix", "seeds", "hops",
                                       "depth")}

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
        self.scale = adapter.rope_scale(model)  # long-context RoPE scales cos and sin: undone when unrotating

    def at(self, positions: torch.Tensor):
        return self.cos[positions], self.sin[positions]


def unrotate(rope: RopeTable, keys, positions):
    """Keys as they were before RoPE (position 0): the inverse rotation at each key's own position."""
    return adapter.invert_rope(keys, *rope.at(positions), rope.scale)


FIELDS = ("keys", "unrotated", "norms", "positions", "relevance", "values", "weighted_values")


@dataclass
class Sums:
    """Per-node sums over the real tokens of one tree level: a parent's sums are its two children's."""

    count: torch.Tensor  # [S], or [H, S] for nodes taken per head
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

        def seg(x):  # pairs add as a + b (what a sum over a size-2 axis gives), without the reduction's cost
            if size == 2:
                return x[..., 0::2, :] + x[..., 1::2, :] if x.dim() == 3 else x[..., 0::2] + x[..., 1::2]
            return x.reshape(*x.shape[:-2], -1, size, x.shape[-1]).sum(-2) if x.dim() == 3 else \
                x.reshape(*x.shape[:-1], -1, size).sum(-1)

        return Sums(seg(self.count), *(seg(getattr(self, name)) for name in FIELDS))

    def take(self, index: torch.Tensor) -> Sums:
        """The sums of nodes `index` [H, K] of every head (count becomes [H, K])."""
        count = self.count.expand_as(self.relevance).gather(1, index)
        return Sums(count, *(getattr(self, name).gather(1, index[..., None].expand(-1, -1, getattr(self, name).shape[-1]))
                             if getattr(self, name).dim() == 3 else getattr(self, name).gather(1, index)
                             for name in FIELDS))

    @classmethod
    def cat(cls, parts: list[Sums]) -> Sums:
        """Nodes of several levels side by side (count [H, S] per part)."""
        return cls(torch.cat([part.count.expand_as(part.relevance) for part in parts], 1),
                   *(torch.cat([getattr(part, name) for part in parts], 1) for name in FIELDS))


def prototypes(rope: RopeTable, sums: Sums, beta: float) -> Nodes:
    """Each node's prototype (a node of one token is that token, exactly)."""
    count = sums.count
    many = count > 1
    if not bool(many.any()):
        zeros = torch.zeros_like(sums.relevance)
        return Nodes(count, sums.keys, sums.values, zeros, sums.positions.round().long(), sums.relevance)
    safe = count.clamp(min=1)
    mean_key = sums.unrotated / safe[..., None]
    coherence = mean_key.norm(dim=-1) / (sums.norms / safe).clamp(min=TINY)
    m_eff = torch.minimum(torch.maximum(count * coherence**2, torch.ones_like(coherence)), count.expand_as(coherence))
    mean_position = torch.round(sums.positions / safe).long()
    proto_keys = adapter.apply_rope(mean_key, *rope.at(mean_position))
    shift = beta * sums.relevance / safe  # weights R + beta, beta = beta x mean R over the node
    weight = sums.relevance + shift * count
    weighted = (sums.weighted_values + shift[..., None] * sums.values) / weight.clamp(min=TINY)[..., None]
    proto_values = torch.where((weight > 0)[..., None], weighted, sums.values / safe[..., None])
    exact = (~many)[..., None]
    return Nodes(
        count=count,
        keys=torch.where(exact, sums.keys, proto_keys),
        values=torch.where(exact, sums.values, proto_values),
        log_weights=torch.where(many, torch.log(m_eff.clamp(min=1)), torch.zeros_like(m_eff)),
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

    def sums(self, depth: int) -> list[Sums]:
        """The sums of every tree level, root level first (`depth` levels, then the tokens' level)."""
        sums = [Sums.of_tokens(self.padded_keys, self.unrotated, self.padded_values, self.positions, self.relevance,
                               self.has)]
        for _ in range(depth):
            sums.append(sums[-1].group(2))
        return sums[::-1]

    def levels(self, rope: RopeTable, beta: float, depth: int) -> list[Nodes]:
        """Prototypes of the `depth` inner tree levels, root level first (a token is its own prototype)."""
        return [prototypes(rope, level, beta) for level in self.sums(depth)[:depth]]


def layer_trees(state: PrefillState, layer: int, plan: Layout, rope: RopeTable) -> LayerTrees:
    """Singletons out, the rest of the compressible tokens of every head in the padded layout."""
    keys, values = state.keys[layer].float(), state.values[layer].float()
    relevance = window_scores(state, layer, plan.window, 1, "none")[:, plan.sinks :]  # [H, n_c]
    heads, compressible = relevance.shape
    singles = top_indices(relevance, plan.singles) if plan.singles else relevance[:, :0].long()
    chosen = torch.zeros(heads, compressible, dtype=torch.bool, device=relevance.device)
    chosen.scatter_(1, singles, True)
    rest = torch.argsort(chosen.to(torch.int8), dim=-1, stable=True)[:, : plan.remaining]  # ascending positions
    has, token = plan.padded()
    index = rest[:, token.to(rest.device)]  # [H, P]
    positions = index + plan.sinks
    rows = torch.arange(heads, device=keys.device)[:, None]
    unrotated = adapter.invert_rope(keys, rope.cos[: keys.shape[1]], rope.sin[: keys.shape[1]], rope.scale)  # each at its own position
    return LayerTrees(keys[rows, positions], unrotated[rows, positions], values[rows, positions], positions,
                      relevance[rows, index], torch.sort(singles, dim=-1).values + plan.sinks, has.to(keys.device))


def layer_gains(state: PrefillState, layer: int, plan: Layout, opts: GraceKVOptions, rope: RopeTable) -> list[torch.Tensor]:
    """Action priorities of one layer: [add roots [H, slots], split level 0 [H, slots], split level k [H, slots 2^k]...]."""
    trees = layer_trees(state, layer, plan, rope)
    has = trees.has
    heads = state.num_kv_heads
    queries = state.window_queries(layer, plan.window, "GraceKV").float()
    queries = queries.reshape(heads, -1, queries.shape[-1])  # [H, g*w, d]: the query heads of a KV head
    logits = torch.matmul(trees.padded_keys, queries.transpose(-1, -2)) * state.scaling  # [H, P, Q]
    logits = logits.masked_fill(~has[:, None], float("-inf"))
    top = logits.amax(1, keepdim=True)  # per-query shift: relative errors do not depend on it
    attn = torch.exp(logits - top)
    costs, counts, relevance = [], [], []  # E = R x D per node, for the inner levels (tokens have E = 0)
    for level, nodes in enumerate(trees.levels(rope, opts.beta, plan.depth)):
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
