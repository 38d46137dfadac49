"""GraceKV's published form: slots cut by curvature, a singleton floor, variable trees, one global heap.

Per prompt and budget: every (layer, KV head) keeps its `sinks` first and `window` last tokens exactly
(charged to the budget unless `ends=free`). The rest of the budget, over all layers and heads, is spent in
two steps: a *singleton floor*, the `singletons` share kept exactly as the tokens of highest value omega x R
over every layer and head; then one global max-heap of actions, highest gain first: *add* a slot's root
(gain omega x R - E: the slot's attention is lost without it) or *split* a present node (`gracekv_split`),
each one entry. Totals are exact: sinks + window + floor + one entry per action = L x H_kv x B.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from ripplekv.engine import adapter, entries
from ripplekv.engine.prefill import PrefillState
from ripplekv.methods.gracekv_signals import signals
from ripplekv.methods.gracekv_slots import boundary_scores, slot_of_tokens
from ripplekv.methods.gracekv_split import BISECT, MIDDLE, PULL, LayerTokens, Level, grow, node_costs
from ripplekv.methods.gracekv_trees import RopeTable, prototypes


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
    relevance, omega = signals(state, sinks, window, opts, rope)
    boundary = boundary_scores(state, opts.widths, opts.spread)
    slot = slot_of_tokens(state, sinks, window, opts)  # [P]
    num_slots = int(slot.max()) + 1 if width else 0
    value = torch.stack([omega[l][:, None] * relevance[l] for l in range(layers)]).reshape(-1)  # [L H P]
    floor = math.floor(opts.singletons * spare * layers * heads)
    order = torch.sort(value, descending=True, stable=True).indices[:floor]
    in_floor = torch.zeros(value.shape[0], dtype=torch.bool, device=value.device)
    in_floor[order] = True
    in_floor = in_floor.reshape(layers, heads * width)
    actions = layers * heads * spare - floor
    tokens = all_tokens(state, sinks, window, relevance, omega, boundary, rope)
    units = torch.arange(layers * heads, device=slot.device)[:, None]
    roots = (slot[None] + num_slots * units).reshape(-1).masked_fill(in_floor.reshape(-1), -1)
    forest = Forest(tokens, roots, layers * heads * num_slots, opts, rope)
    popped = greedy([forest], actions)
    kinds = {"bisect": 0, "pull": 0, "middle": 0}
    names = {BISECT: "bisect", PULL: "pull", MIDDLE: "middle"}
    for levels, _, split in forest.batches:
        for level, gone in zip(levels, split):
            for i in np.nonzero(gone)[0]:
                kinds[names[level.kind[i]]] += 1
    entry = kept_nodes(forest, in_floor.reshape(-1))
    span = heads * width
    built = [layer_entries(state, layer, tokens, entry, layer * span, span, sinks, window, opts.beta, rope)
             for layer in range(layers)]
    counts = np.stack([layer_built.counts.cpu().numpy() for layer_built in built]).astype(np.int64)
    lengths = torch.bincount(slot).cpu().numpy() if width else np.zeros(1, dtype=np.int64)
    notes = {"slots": num_slots, "slot_lengths": [int(lengths.min()), int(np.median(lengths)), int(lengths.max())],
             "floor": floor, "roots_added": popped, "splits": kinds}
    return counts, built, notes


class Forest:
    """One layer's slot trees, priced lazily: a slot's whole tree is grown when the greedy first adds its
    root (a split of it can only enter the heap after that), together with the next unpriced slots by add
    gain (at least as many as are priced already), so a layer is grown in a few batches and the slots the
    budget never reaches are never priced. The heap's order is the one of pricing every tree up front."""

    def __init__(self, lay: LayerTokens, roots: torch.Tensor, num_roots: int, opts, rope):
        self.lay, self.roots, self.num_roots, self.opts, self.rope = lay, roots, num_roots, opts, rope
        idx = torch.nonzero(roots >= 0)[:, 0]
        count, relevance, cost, head = node_costs(lay, idx, roots[idx], num_roots, rope, opts.beta)
        self.add = (lay.omega[head] * relevance - cost).tolist()
        self.count = count.tolist()
        self.batch_of = [-1] * num_roots
        self.batches: list[tuple[list[Level], list[np.ndarray], list[np.ndarray]]] = []  # (levels, present, split)
        self.priced = 0

    def price(self, root: int) -> None:
        """Grow the batch that holds `root`."""
        waiting = sorted((-self.add[r], r) for r in range(self.num_roots) if self.batch_of[r] < 0 and self.count[r] > 0)
        chosen = {root} | {r for _, r in waiting[: max(BATCH, self.priced)]}
        batch = torch.tensor(sorted(chosen), device=self.roots.device)
        inside = torch.zeros(self.num_roots, dtype=torch.bool, device=self.roots.device)
        inside[batch] = True
        roots = self.roots.masked_fill(~inside[self.roots.clamp(min=0)], -1)
        levels, _ = grow(self.lay, roots, self.num_roots, self.opts, self.rope)
        for r in chosen:
            self.batch_of[r] = len(self.batches)
        self.priced += len(chosen)
        self.batches.append((levels, [np.zeros(len(level.count), dtype=bool) for level in levels],
                             [np.zeros(len(level.count), dtype=bool) for level in levels]))


BATCH = 256  # slots priced together at least


def greedy(forests: list[Forest], actions: int) -> int:
    """Pop `actions` actions from one max-heap over every layer's trees, marking present and split nodes in
    each forest's batches; returns how many roots were added. Ties go to the lower (tier, layer, batch, level,
    node); unpriced splits (below `depth`) come after every priced action."""
    heap = [(0, -gain, layer, -1, -1, node) for layer, forest in enumerate(forests)
            for node, gain in enumerate(forest.add) if forest.count[node] > 0]
    heapq.heapify(heap)

    def offer(layer, batch, k, node):
        level = forests[layer].batches[batch][0][k]
        if level.count[node] >= 2:
            heapq.heappush(heap, (0 if level.priced else 1, -level.gain[node], layer, batch, k, node))

    roots = 0
    for _ in range(actions):
        _, _, layer, batch, k, node = heapq.heappop(heap)
        forest = forests[layer]
        if k < 0:
            if forest.batch_of[node] < 0:
                forest.price(node)
            batch = forest.batch_of[node]
            forest.batches[batch][1][0][node] = True
            roots += 1
            offer(layer, batch, 0, node)
            continue
        levels, present, split = forest.batches[batch]
        split[k][node] = True
        first = levels[k].child[node]
        for child in (first, first + 1):
            present[k + 1][child] = True
            offer(layer, batch, k + 1, child)
    return roots


def kept_nodes(forest: Forest, in_floor: torch.Tensor) -> torch.Tensor:
    """Per token, the id of the entry it goes to (a kept node: present and not split, or a floor token);
    -1 for tokens of slots never added."""
    device = forest.lay.keys.device
    entry = torch.full((forest.lay.keys.shape[0],), -1, dtype=torch.long, device=device)
    offset = 0
    for levels, present, split in forest.batches:
        for level, here, gone in zip(levels, present, split):
            kept = torch.as_tensor(here & ~gone, device=device)
            mask = kept[level.nid]
            entry[level.idx[mask]] = offset + level.nid[mask]
            offset += len(level.count)
    entry[in_floor] = offset + torch.arange(int(in_floor.sum()), device=device)  # floor tokens: one node each
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
