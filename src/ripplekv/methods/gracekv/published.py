"""GraceKV's published form: slots cut by curvature, a singleton floor, variable trees, one global heap.

Per prompt and budget: every (layer, KV head) keeps its `sinks` first and `window` last tokens exactly
(charged to the budget unless `ends=free`). The rest of the budget, over all layers and heads, is spent in
two steps: a *singleton floor*, the `singletons` share kept exactly as the tokens of highest value omega x R
over every layer and head; then one global max-heap of actions, highest gain first: *add* a slot's root
(gain omega x R - E: the slot's attention is lost without it) or *split* a present node (`split`),
each one entry. Totals are exact: sinks + window + floor + one entry per action = L x H_kv x B.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from ripplekv.engine import adapter, entries
from ripplekv.engine.prefill import PrefillState
from ripplekv.methods.gracekv.signals import signals
from ripplekv.methods.gracekv.slots import boundary_scores, slot_of_tokens
from ripplekv.methods.gracekv.split import (
    BISECT,
    MIDDLE,
    PULL,
    LayerTokens,
    bisect_side,
    first_by,
    middle_side,
    node_costs,
)
from ripplekv.methods.gracekv.trees import RopeTable, prototypes


def all_tokens(state: PrefillState, sinks: int, window: int, relevance, omega, boundary, rope) -> LayerTokens:
    """Every layer's compressible tokens side by side (unit = layer x H_kv + head), so one tree-growing pass
    serves all layers: the build holds every layer's probe exp-logits at once (L x H_kv x n x g x w floats)."""
    parts = [layer_tokens(state, layer, sinks, window, relevance[layer], omega[layer], boundary, rope)
             for layer in range(state.num_layers)]
    per = parts[0].keys.shape[0]
    units = torch.cat([part.head + layer * state.num_kv_heads for layer, part in enumerate(parts)])
    return LayerTokens(*(torch.cat([getattr(part, name) for part in parts]) for name in
                         ("keys", "unrotated", "values", "positions")), units,
                       *(torch.cat([getattr(part, name) for part in parts]) for name in
                         ("relevance", "boundary", "attn", "queries", "shift", "omega")), state.scaling) if per else parts[0]


def layer_tokens(state: PrefillState, layer: int, sinks: int, window: int, relevance, omega, boundary, rope) -> LayerTokens:
    n, heads = state.length, state.num_kv_heads
    keys = state.keys[layer].float()[:, sinks : n - window]  # [H, P, d]
    positions = torch.arange(sinks, n - window, device=keys.device)
    unrotated = adapter.invert_rope(keys, *rope.at(positions))  # each key at its own position
    queries = state.window_queries(layer, window, "GraceKV").float()
    queries = queries.reshape(heads, -1, queries.shape[-1])  # [H, g x w, d]
    logits = torch.matmul(keys, queries.transpose(-1, -2)) * state.scaling  # [H, P, Q]
    shift = logits.amax(1)  # [H, Q]: relative errors do not depend on it
    attn = torch.exp(logits - shift[:, None])
    flat = positions.shape[0] * heads
    return LayerTokens(
        keys=keys.reshape(flat, -1), unrotated=unrotated.reshape(flat, -1),
        values=state.values[layer].float()[:, sinks : n - window].reshape(flat, -1),
        positions=positions.repeat(heads), head=torch.arange(heads, device=keys.device).repeat_interleave(len(positions)),
        relevance=relevance.reshape(-1), boundary=boundary[sinks : n - window].repeat(heads),
        attn=attn.reshape(flat, -1), queries=queries, shift=shift, omega=omega, scaling=state.scaling)


def build(state: PrefillState, budget: int, opts, rope: RopeTable, sinks: int, window: int):
    """(counts [L, H_kv], entries per layer, notes) for B >= sinks + window and n > B."""
    layers, heads, n = state.num_layers, state.num_kv_heads, state.length
    width = n - window - sinks
    spare = min(budget, width) if opts.ends == "free" else budget - window - sinks
    trees = shared_trees(state, opts, rope, sinks, window)
    floor = math.floor(opts.singletons * spare * layers * heads)
    in_floor = torch.zeros(trees.value_order.shape[0], dtype=torch.bool, device=trees.value_order.device)
    in_floor[trees.value_order[:floor]] = True
    actions = layers * heads * spare - floor
    roots, add = trees.roots(in_floor)
    present, split, popped = trees.greedy(roots, add, actions)
    kinds = {"bisect": 0, "pull": 0, "middle": 0}
    names = {BISECT: "bisect", PULL: "pull", MIDDLE: "middle"}
    for node in np.nonzero(split)[0]:
        kinds[names[trees.kind[node]]] += 1
    entry = trees.kept(present & ~split, in_floor)
    span = heads * width
    built = [layer_entries(state, layer, trees.lay, entry, layer * span, span, sinks, window, opts.beta, rope)
             for layer in range(layers)]
    counts = np.stack([layer_built.counts.cpu().numpy() for layer_built in built]).astype(np.int64)
    lengths = torch.bincount(trees.slot).cpu().numpy() if width else np.zeros(1, dtype=np.int64)
    notes = {"slots": trees.num_slots, "slot_lengths": [int(lengths.min()), int(np.median(lengths)), int(lengths.max())],
             "floor": floor, "roots_added": popped, "splits": kinds}
    return counts, built, notes


def shared_trees(state: PrefillState, opts, rope: RopeTable, sinks: int, window: int) -> Trees:
    """The prompt's slot trees, built once and shared by every budget (`PrefillState.memo`)."""
    key = (shared_trees, sinks, window, opts.mix, opts.seeds, opts.hops, opts.widths, opts.spread, opts.min_slot,
           opts.max_slot, opts.slot, opts.shape, opts.beta, opts.depth)
    return state.memo(key, lambda: build_trees(state, opts, rope, sinks, window))


def build_trees(state: PrefillState, opts, rope: RopeTable, sinks: int, window: int) -> Trees:
    """Every (layer, KV head)'s slot trees over the prompt between the sinks and the window (`shared_trees`)."""
    layers, heads, n = state.num_layers, state.num_kv_heads, state.length
    width = n - window - sinks
    relevance, omega = signals(state, sinks, window, opts, rope)
    boundary = boundary_scores(state, opts.widths, opts.spread)
    slot = slot_of_tokens(state, sinks, window, opts)  # [P]
    num_slots = int(slot.max()) + 1 if width else 0
    value = torch.stack([omega[l][:, None] * relevance[l] for l in range(layers)]).reshape(-1)  # [L H P]
    tokens = all_tokens(state, sinks, window, relevance, omega, boundary, rope)
    units = torch.arange(layers * heads, device=slot.device)[:, None]
    root_of = (slot[None] + num_slots * units).reshape(-1)
    return Trees(tokens, root_of, layers * heads * num_slots, slot, num_slots,
                 torch.sort(value, descending=True, stable=True).indices, opts, rope)


PRICE_ALL = False  # price every node of every tree a budget adds (what `reach` saves; tests compare the two)


CHUNK_TOKENS = 4096  # tokens priced per batch: a batch's temporaries (a few MB) stay in cache, never mapped afresh


def chunks(items: list[int], sizes: list[int]) -> list[list[int]]:
    """`items` cut in order into runs of at most CHUNK_TOKENS summed sizes (one item at least per run)."""
    runs, run, total = [], [], 0
    for item, size in zip(items, sizes):
        if run and total + size > CHUNK_TOKENS:
            runs.append(run)
            run, total = [], 0
        run.append(item)
        total += size
    return [*runs, run] if run else runs


def _room(buffer: np.ndarray, size: int) -> np.ndarray:
    """`buffer` with room for `size` items (doubled as needed, its contents kept)."""
    if size <= len(buffer):
        return buffer
    grown = np.zeros(max(size, 2 * len(buffer)), dtype=buffer.dtype)
    grown[: len(buffer)] = buffer
    return grown


def kth_smallest(keys: list[np.ndarray], k: int) -> tuple[int, float]:
    """The k-th smallest (tier, value) of values given per tier ([tier 0, tier 1]); above every key when fewer."""
    for tier, values in enumerate(keys):
        if k <= len(values):
            return (tier, float(np.partition(values, k - 1)[k - 1]))
        k -= len(values)
    return (2, 0.0)


class Trees:
    """Every slot tree of one prompt, shared by all budgets and priced only where a budget's greedy can reach.

    A node is a set of one unit's tokens (`members[start : start + count]`, in position order); pricing it
    computes its split gain and kind and makes its two children (their costs E come with the parent's
    pricing). Roots are a slot's tokens less that budget's floor; since floors of larger budgets contain
    those of smaller ones, a root is keyed by its slot and how many of its tokens the floor took, and its tree
    is shared by every budget that keys it alike.

    Which nodes a budget prices (`greedy`): the heap pops actions in the order of their path maxima of
    (tier, -gain) (`methods.gracekv.greedy_order` explains why), so the first A pops are the A smallest of
    those. An unpriced split of a present node has gain <= E(node) (children's E >= 0): its key is at least
    max(its parent action's key, (0, -E)). So with tau the A-th smallest key among the actions priced so
    far, nodes whose lower bound exceeds tau can never be among the first A pops; the others are priced,
    level by level in one batch each, until none is left; then the heap runs over priced nodes alone."""

    def __init__(self, lay: LayerTokens, root_of, num_roots: int, slot, num_slots: int, value_order, opts, rope):
        self.lay, self.root_of, self.num_roots, self.opts, self.rope = lay, root_of, num_roots, opts, rope
        self.slot, self.num_slots, self.value_order = slot, num_slots, value_order
        # floor rank of every token: a root loses its tokens to the floor in this order as budgets grow
        self.rank = torch.empty_like(value_order)
        self.rank[value_order] = torch.arange(len(value_order), device=value_order.device)
        self.members = np.zeros(1 << 16, dtype=np.int64)  # node tokens, node after node (grown by doubling)
        self.used = 0
        self.start: list[int] = []
        self.count: list[int] = []
        self.cost = np.zeros(1 << 12, dtype=np.float32)  # E per node, as float32 (grown by doubling)
        self.level: list[int] = []
        self.path: list[int] = []  # the sides taken from the root, as bits (ties order by it, as levels did)
        self.root: list[int] = []  # the slot's root id (unit x slots + slot)
        self.gain: list[float] = []
        self.kind: list[int] = []
        self.child: list[int] = []  # first child's node id (-1: not priced yet, or one token)
        self.keyed: dict[tuple[int, int], int] = {}  # (root id, tokens floored) -> root node
        self.add_gain: dict[int, float] = {}  # root node -> omega x R - E

    def _add_nodes(self, tokens: np.ndarray, counts: np.ndarray, costs, level, path, root) -> int:
        first = len(self.count)
        self.members = _room(self.members, self.used + len(tokens))
        self.members[self.used : self.used + len(tokens)] = tokens
        self.start += (self.used + np.cumsum(counts) - counts).tolist()
        self.used += len(tokens)
        self.count += counts.tolist()
        self.cost = _room(self.cost, first + len(counts))
        self.cost[first : first + len(counts)] = costs
        self.level += list(level)
        self.path += list(path)
        self.root += list(root)
        self.gain += [-math.inf] * len(counts)
        self.kind += [BISECT] * len(counts)
        self.child += [-1] * len(counts)
        return first

    def _tokens_of(self, nodes) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, nid): the tokens of `nodes` node by node, each node's in position order, and their index in `nodes`."""
        starts = np.asarray([self.start[i] for i in nodes], dtype=np.int64)
        counts = np.asarray([self.count[i] for i in nodes], dtype=np.int64)
        nid = np.repeat(np.arange(len(nodes)), counts)
        offsets = np.arange(len(nid)) - np.repeat(np.cumsum(counts) - counts, counts)
        idx = self.members[np.repeat(starts, counts) + offsets]
        device = self.lay.keys.device
        return torch.as_tensor(idx, device=device), torch.as_tensor(nid, device=device)

    def roots(self, in_floor: torch.Tensor) -> tuple[list[int], list[float]]:
        """This budget's root nodes (slots with tokens left after the floor) and their add gains omega x R - E;
        roots not seen at an earlier budget are made and priced together, as one batch."""
        kept = ~in_floor
        floored = torch.bincount(self.root_of[in_floor], minlength=self.num_roots).tolist()
        left = torch.bincount(self.root_of[kept], minlength=self.num_roots).tolist()
        wanted = [r for r in range(self.num_roots) if left[r] > 0]
        new = [r for r in wanted if (r, floored[r]) not in self.keyed]
        for part in chunks(new, [left[r] for r in new]):
            fresh = torch.zeros(self.num_roots, dtype=torch.bool, device=in_floor.device)
            fresh[part] = True
            idx = torch.nonzero(kept & fresh[self.root_of])[:, 0]
            idx = idx[torch.argsort(self.root_of[idx], stable=True)]  # root by root, each in position order
            nid_of = torch.full((self.num_roots,), -1, dtype=torch.long, device=idx.device)
            nid_of[part] = torch.arange(len(part), device=idx.device)
            nid = nid_of[self.root_of[idx]]
            count, relevance, cost, head = node_costs(self.lay, idx, nid, len(part), self.rope, self.opts.beta)
            add = (self.lay.omega[head] * relevance - cost).tolist()
            first = self._add_nodes(idx.cpu().numpy(), count.long().cpu().numpy(), cost.cpu().numpy(),
                                    [0] * len(part), [0] * len(part), part)
            for i, r in enumerate(part):
                self.keyed[(r, floored[r])] = first + i
                self.add_gain[first + i] = add[i]
        nodes = [self.keyed[(r, floored[r])] for r in wanted]
        return nodes, [self.add_gain[node] for node in nodes]

    def price(self, nodes: list[int]) -> None:
        """Split gain, kind and children of unpriced nodes of two tokens or more, in one batch: priced levels
        (< depth) by the better of bisect and pull (`split`), deeper ones at their middle with gain -level."""
        deep = [i for i in nodes if self.level[i] >= self.opts.depth]
        shallow = [i for i in nodes if self.level[i] < self.opts.depth]
        for group, priced in [(part, True) for part in chunks(shallow, [self.count[i] for i in shallow])] + \
                [(part, False) for part in chunks(deep, [self.count[i] for i in deep])]:
            lay, count = self.lay, len(group)
            idx, nid = self._tokens_of(group)
            if priced:
                cost = torch.as_tensor(self.cost[group], device=idx.device)
                right = bisect_side(lay, idx, nid, count)
                pulled = first_by(lay.relevance[idx], lay.positions[idx], nid, count)
                keep = ~pulled  # one pass prices both kinds: bisect children 0..2N-1, pull remainders 2N..3N-1
                _, _, both, _ = node_costs(lay, torch.cat([idx, idx[keep]]), torch.cat([2 * nid + right, 2 * count + nid[keep]]),
                                           3 * count, self.rope, self.opts.beta)
                cost2, cost3 = both[: 2 * count], both[2 * count :]
                gain_bisect = cost - cost2[0::2] - cost2[1::2]
                gain_pull = cost - cost3
                use_pull = gain_pull > gain_bisect
                side = torch.where(use_pull[nid], pulled, right)
                gain = torch.maximum(gain_bisect, gain_pull).tolist()
                kind = torch.where(use_pull, PULL, BISECT).tolist()
                first_cost = torch.where(use_pull, cost3, cost2[0::2])
                second_cost = torch.where(use_pull, torch.zeros_like(cost3), cost2[1::2])
                child_cost = torch.stack([first_cost, second_cost], 1).reshape(-1).cpu().numpy()
            else:
                sizes = torch.as_tensor([self.count[i] for i in group], device=idx.device, dtype=torch.float32)
                side = middle_side(idx, nid, count, sizes)
                gain = [-float(self.level[i]) for i in group]
                kind = [MIDDLE] * count
                child_cost = np.zeros(2 * count, dtype=np.float32)
            part = 2 * nid + side.long()
            order = torch.argsort(part, stable=True)  # each child's tokens stay in position order
            sizes = torch.bincount(part, minlength=2 * count).cpu().numpy()
            level = [self.level[i] + 1 for i in group for _ in (0, 1)]
            path = [2 * self.path[i] + s for i in group for s in (0, 1)]
            root = [self.root[i] for i in group for _ in (0, 1)]
            first = self._add_nodes(idx[order].cpu().numpy(), sizes, child_cost, level, path, root)
            for k, i in enumerate(group):
                self.gain[i], self.kind[i], self.child[i] = gain[k], kind[k], first + 2 * k

    def _key(self, node: int) -> tuple[int, float]:
        """A priced split's heap key (tier, -gain): unpriced levels pop after every priced action."""
        return (0 if self.level[node] < self.opts.depth else 1, -self.gain[node])

    def _bound(self, node: int) -> tuple[int, float]:
        """The least key an unpriced split of `node` can have."""
        return (0, -float(self.cost[node])) if self.level[node] < self.opts.depth else (1, -float(self.level[node]))

    def greedy(self, roots: list[int], add: list[float], actions: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Pop `actions` actions from one max-heap of adds and splits; returns (present, split) per node and
        how many roots were added. Ties go to adds, then the lower (level, root, path)."""
        self.reach(roots, add, actions)
        present = np.zeros(len(self.count), dtype=bool)
        split = np.zeros(len(self.count), dtype=bool)
        heap = [(0, -gain, 0, 0, self.root[node], 0, node) for node, gain in zip(roots, add)]
        heapq.heapify(heap)

        def offer(node):
            if self.count[node] >= 2:
                key = self._key(node) if self.child[node] >= 0 else self._bound(node)
                heapq.heappush(heap, (*key, 1, self.level[node], self.root[node], self.path[node], node))

        added = 0
        for _ in range(actions):
            _, _, is_split, _, _, _, node = heapq.heappop(heap)
            if not is_split:
                present[node] = True
                added += 1
                offer(node)
                continue
            if self.child[node] < 0:
                raise AssertionError("gracekv popped a split it had not priced")
            split[node] = True
            for child in (self.child[node], self.child[node] + 1):
                present[child] = True
                offer(child)
        return present, split, added

    def reach(self, roots: list[int], add: list[float], actions: int) -> None:
        """Price every node whose split could be among the first `actions` pops (see the class docstring)."""
        limit = (2, 0.0)  # above every key
        known = [np.asarray([-gain for gain in add], dtype=np.float64), np.zeros(0)]  # priced actions' path maxima, by tier
        frontier = [(node, (0, -gain)) for node, gain in zip(roots, add)]  # (node, its parent action's path max)
        while frontier:
            limit = limit if PRICE_ALL else min(limit, kth_smallest(known, actions))
            wanted = [(node, above) for node, above in frontier
                      if self.count[node] >= 2 and max(above, self._bound(node)) <= limit]
            self.price([node for node, _ in wanted if self.child[node] < 0])
            frontier, found = [], ([], [])
            for node, above in wanted:
                path_max = max(above, self._key(node))
                found[path_max[0]].append(path_max[1])
                frontier += [(self.child[node], path_max), (self.child[node] + 1, path_max)]
            known = [np.concatenate([part, np.asarray(more, dtype=np.float64)]) for part, more in zip(known, found)]

    def kept(self, kept_nodes: np.ndarray, in_floor: torch.Tensor) -> torch.Tensor:
        """Per token, the id of the entry it goes to (a kept node, or a floor token); -1 for tokens of slots never
        added. Ids follow (root, level, path), then floor tokens: the order entries at one position keep."""
        device = self.lay.keys.device
        entry = torch.full((self.lay.keys.shape[0],), -1, dtype=torch.long, device=device)
        nodes = np.nonzero(kept_nodes)[0]
        nodes = nodes[np.lexsort(([self.path[i] for i in nodes], [self.level[i] for i in nodes],
                                  [self.root[i] for i in nodes]))] if len(nodes) else nodes
        idx, nid = self._tokens_of(nodes.tolist())
        entry[idx] = nid
        entry[in_floor] = len(nodes) + torch.arange(int(in_floor.sum()), device=device)  # floor tokens: one node each
        return entry


def layer_entries(state, layer: int, tokens: LayerTokens, entry, start: int, span: int, sinks: int, window: int,
                  beta: float, rope) -> entries.LayerEntries:
    """Sinks, floor, the kept nodes and the window of one layer (its tokens start..start + span), in
    position order per head."""
    n, heads = state.length, state.num_kv_heads
    device = tokens.keys.device
    mine = entry[start : start + span]
    used = mine >= 0
    ids, nid = torch.unique(mine[used], return_inverse=True)
    idx = torch.nonzero(used)[:, 0] + start
    nodes = prototypes(rope, tokens.sums(idx, nid, len(ids)), beta)
    node_head = torch.zeros(len(ids), dtype=torch.long, device=device).index_put_((nid,), tokens.head[idx] - layer * heads)
    keys, values = state.keys[layer], state.values[layer]
    ends = torch.cat([torch.arange(sinks, device=device), torch.arange(n - window, n, device=device)])
    head = torch.cat([node_head, torch.arange(heads, device=device).repeat_interleave(len(ends))])
    positions = torch.cat([nodes.positions[0], ends.repeat(heads)])
    all_keys = torch.cat([nodes.keys[0], keys[:, ends].float().reshape(-1, keys.shape[-1])])
    all_values = torch.cat([nodes.values[0], values[:, ends].float().reshape(-1, values.shape[-1])])
    weights = torch.cat([nodes.log_weights[0], torch.zeros(heads * len(ends), device=device)])
    order = torch.argsort(head * (n + 1) + positions, stable=True)
    counts = torch.bincount(head, minlength=heads)
    longest = int(counts.max())
    slot_in_head = torch.arange(len(order), device=device) - (torch.cumsum(counts, 0) - counts)[head[order]]
    rows, cols = head[order], slot_in_head
    out_keys = torch.zeros(heads, longest, keys.shape[-1], dtype=keys.dtype, device=device)
    out_values = torch.zeros(heads, longest, values.shape[-1], dtype=values.dtype, device=device)
    out_keys[rows, cols] = all_keys[order].to(keys.dtype)
    out_values[rows, cols] = all_values[order].to(values.dtype)
    out_positions = torch.full((heads, longest), -1, dtype=torch.long, device=device)
    out_positions[rows, cols] = positions[order]
    out_weights = torch.zeros(heads, longest, device=device)
    out_weights[rows, cols] = weights[order].float()
    return entries.LayerEntries(keys=out_keys, values=out_values, positions=out_positions, counts=counts,
                                log_weights=out_weights)
