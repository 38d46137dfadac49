"""GraceKV's variable trees (the published form): each slot's tree, grown by the better of two split kinds.

A node is a set of one head's tokens with one prototype (`trees.prototypes`). Its distortion over
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

from ripplekv.methods.gracekv.trees import LARGE, TINY, Sums, prototypes

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

    def __post_init__(self):
        # per token, once: what every node's sums and value spread read (a row's norm is the same alone or in a batch)
        self.unrotated_norms = self.unrotated.norm(dim=-1)
        self.value_norms = self.values.norm(dim=-1)

    def sums(self, idx, nid, nodes: int, exact_keys: bool = True, groups=None) -> Sums:
        """Sums of nodes `nid` over tokens `idx` as [1, nodes] (the layout `prototypes` takes), in one product.
        Without `exact_keys` the rotated keys are not summed (a one-token node's key is then wrong: pricing
        never reads it, since a single token has no distortion). `groups`: `grouping(nid, nodes)`, when made."""
        unrot, values, rel = self.unrotated[idx], self.values[idx], self.relevance[idx]
        ones = torch.ones(len(idx), 1, device=unrot.device)
        scalars = torch.cat([ones, self.unrotated_norms[idx, None], self.positions[idx, None].float(), rel[:, None]], 1)
        vectors = [self.keys[idx], unrot, values, rel[:, None] * values] if exact_keys else [unrot, values, rel[:, None] * values]
        total = segment_sum(nid, torch.cat([scalars, *vectors], 1), nodes, groups)[None]
        d = unrot.shape[1]
        count, norms, positions, relevance = total[..., 0], total[..., 1], total[..., 2], total[..., 3]
        parts = [total[..., 4 + i * d : 4 + (i + 1) * d] for i in range(len(vectors))]
        if not exact_keys:
            parts = [parts[0], *parts]
        return Sums(count, parts[0], parts[1], norms, positions, relevance, parts[2], parts[3])


def grouping(nid: torch.Tensor, nodes: int, dtype=torch.float32) -> torch.Tensor:
    """The sparse (nodes x A) one-hot matrix that sums rows by node `nid` [A] (`segment_sum`); made once, it
    serves every sum over the same rows."""
    rows = torch.stack([nid, torch.arange(len(nid), device=nid.device)])
    return torch.sparse_coo_tensor(rows, torch.ones(len(nid), device=nid.device, dtype=dtype), (nodes, len(nid)),
                                   is_coalesced=True, check_invariants=False)


def segment_sum(nid: torch.Tensor, x: torch.Tensor, nodes: int, groups=None) -> torch.Tensor:
    """Sums of the rows of `x` [A] or [A, k] by node `nid` [A], as a sparse (nodes x A) one-hot product
    (several times faster on a CPU than index_add_ or scatter_add_ over rows); `groups`: `grouping(nid, nodes)`."""
    flat = x if x.dim() == 2 else x[:, None]
    if not len(nid):
        out = torch.zeros(nodes, flat.shape[1], device=x.device, dtype=x.dtype)
    else:
        out = torch.sparse.mm(grouping(nid, nodes, x.dtype) if groups is None else groups, flat)
    return out if x.dim() == 2 else out[:, 0]


def node_costs(lay: LayerTokens, idx, nid, nodes: int, rope, beta: float):
    """(count [N], relevance [N], E [N], head [N]) of nodes `nid` over tokens `idx`."""
    groups = grouping(nid, nodes)
    sums = lay.sums(idx, nid, nodes, exact_keys=False, groups=groups)
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
    far = (lay.values[idx] - proto.values[0][nid]).norm(dim=-1)
    masses = segment_sum(nid, torch.cat([attn, attn * far[:, None], attn * lay.value_norms[idx, None]], 1), nodes, groups)
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
