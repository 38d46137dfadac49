"""GraceKV's variable trees (the published form): each slot's tree, grown by the better of two split kinds.

A node is a set of one head's tokens with one prototype (`gracekv_trees.prototypes`). Its distortion over
the probe queries q (the window's queries of its KV head) is D = mean_q (mass error + output error) / 2:
mass error |m'_q - m_q| / m_q, m_q the node's true attention mass (exp-logits) and m'_q its prototype's;
output error sum_j a_qj |v_j - v'| / sum_j a_qj |v_j|, the attention-weighted distance of the node's values to
the prototype's value (a bound on the change of the node's output that needs no per-query value sums: our
choice). E = omega x R x D, R the node's relevance, omega its head's weight.

A node of two or more tokens splits one of two ways, whichever lowers E more: *bisect* at its curvature
peak (the token after its first with the highest boundary score starts the right child) or *pull* its most
relevant token out as an exact singleton (the rest stays one prototype). Either costs one entry, so gains per
unit cost are gains. Below `depth` priced levels a node bisects at its middle without pricing (those splits
come last in the greedy; they exist so any budget below the prompt length can be spent exactly).

Tokens of a node lie in position order inside `idx` (a node's tokens are contiguous among the tokens that
are still being split: a pulled token is a leaf), which `middle` relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.methods.gracekv_trees import LARGE, TINY, Sums, prototypes

BISECT, PULL, MIDDLE = 0, 1, 2


@dataclass
class LayerTokens:
    """Compressible tokens, flat over units (index unit x P + p; one layer's heads, or every layer's)."""

    keys: torch.Tensor  # [T, d] float32, rotated
    unrotated: torch.Tensor  # [T, d]
    values: torch.Tensor  # [T, d]
    positions: torch.Tensor  # [T] long, prompt positions
    head: torch.Tensor  # [T] long: the token's unit (layer x H_kv + KV head)
    relevance: torch.Tensor  # [T]
    boundary: torch.Tensor  # [T] boundary score at the token's position
    attn: torch.Tensor  # [T, Q] probe exp-logits, shifted per (head, query)
    queries: torch.Tensor  # [U, Q, d] per unit
    shift: torch.Tensor  # [U, Q]
    omega: torch.Tensor  # [U]
    scaling: float

    def sums(self, idx, nid, nodes: int, exact_keys: bool = True) -> Sums:
        """Sums of nodes `nid` over tokens `idx` as [1, nodes] (the layout `prototypes` takes), in one product.
        Without `exact_keys` the rotated keys are not summed (a one-token node's key is then wrong: pricing
        never reads it, since a single token has no distortion)."""
        keys, unrot, values, rel = self.keys[idx], self.unrotated[idx], self.values[idx], self.relevance[idx]
        ones = torch.ones(len(idx), 1, device=keys.device)
        scalars = torch.cat([ones, unrot.norm(dim=-1, keepdim=True), self.positions[idx, None].float(), rel[:, None]], 1)
        vectors = [keys, unrot, values, rel[:, None] * values] if exact_keys else [unrot, values, rel[:, None] * values]
        total = segment_sum(nid, torch.cat([scalars, *vectors], 1), nodes)[None]
        d = keys.shape[1]
        count, norms, positions, relevance = total[..., 0], total[..., 1], total[..., 2], total[..., 3]
        parts = [total[..., 4 + i * d : 4 + (i + 1) * d] for i in range(len(vectors))]
        if not exact_keys:
            parts = [parts[0], *parts]
        return Sums(count, parts[0], parts[1], norms, positions, relevance, parts[2], parts[3])


def segment_sum(nid: torch.Tensor, x: torch.Tensor, nodes: int) -> torch.Tensor:
    """Sums of the rows of `x` [A] or [A, k] by node `nid` [A], as a sparse (nodes x A) one-hot product
    (several times faster on a CPU than index_add_ or scatter_add_ over rows)."""
    flat = x if x.dim() == 2 else x[:, None]
    rows = torch.stack([nid, torch.arange(len(nid), device=nid.device)])
    ones = torch.sparse_coo_tensor(rows, torch.ones(len(nid), device=x.device, dtype=x.dtype), (nodes, len(nid)),
                                   is_coalesced=True, check_invariants=False)
    out = torch.sparse.mm(ones, flat) if len(nid) else torch.zeros(nodes, flat.shape[1], device=x.device, dtype=x.dtype)
    return out if x.dim() == 2 else out[:, 0]


@dataclass
class Level:
    idx: torch.Tensor  # tokens in this level's nodes
    nid: torch.Tensor  # their node
    count: list  # per node
    gain: list  # split gain per node (-inf: a single token)
    kind: list  # BISECT, PULL or MIDDLE
    child: list  # index of the first child in the next level (-1: none)
    priced: bool


def node_costs(lay: LayerTokens, idx, nid, nodes: int, rope, beta: float):
    """(count [N], relevance [N], E [N], head [N]) of nodes `nid` over tokens `idx`."""
    sums = lay.sums(idx, nid, nodes, exact_keys=False)
    proto = prototypes(rope, sums, beta)
    count, relevance = sums.count[0], sums.relevance[0]
    head = torch.zeros(nodes, dtype=torch.long, device=idx.device).index_put_((nid,), lay.head[idx])
    queries = lay.queries.shape[1]
    order = torch.argsort(head, stable=True)  # each node against its own unit's probe queries, unit by unit
    sizes = torch.bincount(head, minlength=lay.queries.shape[0]).tolist()
    blocks = torch.split(proto.keys[0][order], sizes)
    logits = torch.empty(nodes, queries, device=idx.device)
    logits[order] = torch.cat([block @ lay.queries[u].T for u, block in enumerate(blocks) if len(block)])
    logits = logits * lay.scaling
    proto_mass = torch.exp(logits - lay.shift[head] + proto.log_weights[0][:, None])
    attn = lay.attn[idx]
    values = lay.values[idx]
    far = (values - proto.values[0][nid]).norm(dim=-1)
    masses = segment_sum(nid, torch.cat([attn, attn * far[:, None], attn * values.norm(dim=-1)[:, None]], 1), nodes)
    true_mass, spread, scale = masses[:, :queries], masses[:, queries : 2 * queries], masses[:, 2 * queries :]
    mass_error = ((proto_mass - true_mass).abs() / true_mass.clamp(min=TINY)).clamp(max=LARGE)
    output_error = (spread / scale.clamp(min=TINY)).clamp(max=LARGE)
    distortion = torch.where(count > 1, (mass_error + output_error).mean(-1) * 0.5, torch.zeros_like(count))
    return count, relevance, lay.omega[head] * relevance * distortion, head


def first_by(key, order, nid, nodes: int):
    """Per token: is it its node's first token by (max `key`, then smallest `order`)?"""
    top = torch.full((nodes,), -torch.inf, device=key.device).scatter_reduce(0, nid, key, "amax")
    candidate = key == top[nid]
    big = torch.iinfo(torch.long).max
    least = torch.full((nodes,), big, device=key.device, dtype=torch.long)
    least = least.scatter_reduce(0, nid, torch.where(candidate, order, big), "amin")
    return order == least[nid]


def bisect_side(lay: LayerTokens, idx, nid, nodes: int):
    """True for tokens at or after their node's curvature peak (the peak is never the node's first token)."""
    positions = lay.positions[idx]
    start = torch.full((nodes,), torch.iinfo(torch.long).max, device=idx.device, dtype=torch.long)
    start = start.scatter_reduce(0, nid, positions, "amin")
    score = torch.where(positions == start[nid], -torch.inf, lay.boundary[idx])
    peak = first_by(score, positions, nid, nodes)
    at = torch.zeros(nodes, dtype=torch.long, device=idx.device).index_put_((nid[peak],), positions[peak])
    return positions >= at[nid]


def middle_side(idx, nid, nodes: int, count):
    """True for the later half of each node's tokens (tokens of a node are contiguous in `idx` order)."""
    rank = torch.arange(len(idx), device=idx.device)
    first = torch.full((nodes,), len(idx), device=idx.device, dtype=torch.long).scatter_reduce(0, nid, rank, "amin")
    return (rank - first[nid]) >= torch.div(count.long(), 2, rounding_mode="floor")[nid]


def grow(lay: LayerTokens, roots: torch.Tensor, num_roots: int, opts, rope) -> tuple[list[Level], torch.Tensor]:
    """Every level of the layer's trees (root level first) and the roots' add gains omega x R - E."""
    idx = torch.nonzero(roots >= 0)[:, 0]
    nid = roots[idx]
    count, relevance, cost, head = node_costs(lay, idx, nid, num_roots, rope, opts.beta)
    add = lay.omega[head] * relevance - cost
    levels = []
    nodes = num_roots
    while True:
        multi = count >= 2
        gain = torch.full((nodes,), -torch.inf, device=idx.device)
        kind = torch.zeros(nodes, dtype=torch.long, device=idx.device)
        children = torch.cumsum(multi.long(), 0) - 1
        child = torch.where(multi, 2 * children, -1)
        priced = len(levels) < opts.depth
        level = Level(idx, nid, count.tolist(), [], [], child.tolist(), priced)
        levels.append(level)
        if not bool(multi.any()):
            level.gain, level.kind = gain.tolist(), kind.tolist()
            return levels, add
        active = multi[nid]
        aidx, anid = idx[active], nid[active]
        if priced:
            right = bisect_side(lay, aidx, anid, nodes)
            pulled = first_by(lay.relevance[aidx], lay.positions[aidx], anid, nodes)
            keep = ~pulled  # one pass prices both kinds: bisect children 0..2N-1, pull remainders 2N..3N-1
            _, _, both, _ = node_costs(lay, torch.cat([aidx, aidx[keep]]), torch.cat([2 * anid + right, 2 * nodes + anid[keep]]),
                                       3 * nodes, rope, opts.beta)
            cost2, cost3 = both[: 2 * nodes], both[2 * nodes :]
            gain_bisect = cost - cost2[0::2] - cost2[1::2]
            gain_pull = cost - cost3
            use_pull = gain_pull > gain_bisect
            side = torch.where(use_pull[anid], pulled, right)
            gain = torch.where(multi, torch.maximum(gain_bisect, gain_pull), gain)
            kind = torch.where(use_pull, PULL, BISECT)
            first_cost = torch.where(use_pull, cost3, cost2[0::2])
            second_cost = torch.where(use_pull, torch.zeros_like(cost3), cost2[1::2])
            next_cost = torch.stack([first_cost, second_cost], 1)[multi].reshape(-1)
        else:
            side = middle_side(aidx, anid, nodes, count)
            gain = torch.where(multi, -float(len(levels)), gain)  # unpriced: shallower first
            kind = torch.full_like(kind, MIDDLE)
            next_cost = None
        level.gain, level.kind = gain.tolist(), kind.tolist()
        idx, nid = aidx, 2 * children[anid] + side.long()
        nodes = 2 * int(multi.sum())
        count = segment_sum(nid, torch.ones(len(idx), device=idx.device), nodes)
        cost = next_cost if next_cost is not None else torch.zeros(nodes, device=idx.device)
