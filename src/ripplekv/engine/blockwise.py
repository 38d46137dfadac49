"""Block-wise prefill (`eval --protocol blockwise`): the prompt read in blocks, one method evicting after each.

KeyDiff's setting (kvpress's `BlockPress`): a cache that never holds the whole prompt. The first read is a plain
prefill of B + r tokens (1 <= r <= b; the whole prompt when it has at most B + b tokens), every later read exactly
b tokens (blocks are counted from the prompt's end, so the last one is never short of an observation window). After
each read the method compresses what the cache holds (its kept entries, then the block) down to its budget B, so
no (layer, KV head) ever holds more than B + b entries, and at the end each holds exactly B: the same L x H_kv x B
entries as a whole-prompt compression. Unlike kvpress, which scores blocks of one full-attention prefill, a block
here attends only to what was kept: its keys and values are those a bounded cache would compute.

Each read is scored as a prompt of its own (`PrefillState`): the kept entries first, in prompt order, then the
block, with the block's last queries as the observation window. A scorer sees entry indices, not prompt positions,
so only scorers that rank from keys, values and that window can run (`methods.core.blockwise` says which).

It costs one prefill per variant (the kept entries, hence every later block's keys, differ per method and budget),
against one per sample for the other protocols.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import DynamicCache

from ripplekv.engine import adapter, timings
from ripplekv.engine.entries import LayerEntries
from ripplekv.engine.prefill import PrefillState, Requirements, captured_window, prefill_for
from ripplekv.engine.recorders import WINDOW_QUERIES, SampleContext, Setup, WindowQueries, keep


def block_bounds(length: int, budget: int, block: int) -> list[tuple[int, int]]:
    """(start, end) of each read of a `length`-token prompt: the first B + 1 to B + b tokens (all of them when
    n <= B + b), then blocks of exactly `block` tokens."""
    if block < 1:
        raise ValueError(f"a block holds at least one token, got {block}")
    if length <= budget + block:
        return [(0, length)]
    later = -(-(length - budget - block) // block)
    first = length - later * block
    return [(0, first)] + [(start, start + block) for start in range(first, length, block)]


@dataclass
class BlockwiseResult:
    """One variant's block-wise prefill: its entries (prompt positions), the logits after the prompt's last token
    (computed through its own compressed cache), the most entries one (layer, KV head) held at once (the block's
    beside the kept ones, read off the tensors scored), and how many reads it took."""

    entries: list[LayerEntries]
    last_logits: torch.Tensor
    peak_entries: int
    reads: int


@torch.inference_mode()
def blockwise_prefill(model, input_ids, method, budget: int, block: int, needs: Requirements,
                      reserve: int = 0) -> BlockwiseResult:
    """Read `input_ids` in blocks of `block` tokens, `method` compressing to `budget` after each (see above)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(adapter.device(model))
    adapter.check_length(model.config, len(ids), reserve)
    bounds = block_bounds(len(ids), budget, block)
    state = prefill_for(model, ids[: bounds[0][1]], needs)
    kept, logits, peak = compress_read(state, method, budget, None), state.last_logits, state.length
    del state
    window = captured_window(needs)
    for start, end in bounds[1:]:
        state, positions = read_block(model, ids[start:end], kept, start, window)
        del kept
        peak = max(peak, max(int(keys.shape[1]) for keys in state.keys))
        kept, logits = compress_read(state, method, budget, positions), state.last_logits
        del state, positions
    return BlockwiseResult(kept, logits, peak, len(bounds))


@torch.inference_mode()
def read_block(model, tokens: torch.Tensor, kept: list[LayerEntries], start: int,
               window: int) -> tuple[PrefillState, list[torch.Tensor]]:
    """The block `tokens` (prompt positions start..) read after the `kept` entries: a state whose layers hold the
    kept entries then the block's (each head in prompt order), and per layer the prompt position of every index
    [H_kv, m]. Every head of a layer keeps as many entries, so they make a plain cache: the block's queries see
    every kept entry and the block causally, through the model's own attention (as the whole prompt's prefill), at
    their prompt positions. The state's `input_ids` are -1: one index holds different tokens in different heads."""
    cache = DynamicCache()
    for index, entry in enumerate(kept):
        if int(entry.counts.min()) != entry.capacity or entry.log_weights is not None:
            raise ValueError(f"block-wise prefill keeps the same count of tokens in every head of a layer; layer "
                             f"{index} holds {entry.counts.tolist()}")
        cache.update(entry.keys[None], entry.values[None], index)
    held = kept[0].capacity
    if any(entry.capacity != held for entry in kept):
        raise ValueError("block-wise prefill keeps the same count in every layer; the layers' counts differ")
    recorder = WindowQueries(Setup(model, len(tokens), min(window, len(tokens)), SampleContext()))
    where = torch.arange(start, start + len(tokens), device=tokens.device)
    out = model(input_ids=tokens[None], position_ids=where[None], cache_position=held + where - start, cache=cache,
                use_cache=True, logits_to_keep=1, ripplekv_recorders=[recorder])
    dyn = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    layers = range(len(kept))
    positions = [torch.cat([kept[i].positions, where.expand(kept[i].num_heads, -1)], dim=1) for i in layers]
    state = PrefillState(input_ids=torch.full((held + len(tokens),), -1, dtype=torch.long, device=tokens.device),
                         keys=[dyn.layers[i].keys[0] for i in layers], values=[dyn.layers[i].values[0] for i in layers],
                         last_logits=out.logits[0, -1].float(), scaling=adapter.attention_scaling(model), model=model)
    keep(state, WINDOW_QUERIES, recorder.result(len(kept)))
    return state, positions


def compress_read(state: PrefillState, method, budget: int, positions: list[torch.Tensor] | None) -> list[LayerEntries]:
    """`method`'s entries of one read's `state` at `budget`, their positions mapped to the prompt's (`positions`:
    each index's prompt position per layer; None when the state is the prompt's start itself). The one eviction step
    of the protocol (`scripts/check_references_axes.py` runs it on kvpress's blocks)."""
    built = method.compress(state, budget)
    if positions is None:
        return built
    mapped = []
    for entry, where in zip(built, positions):
        held = entry.positions >= 0
        prompt = where.gather(1, entry.positions.clamp_min(0)).masked_fill(~held, -1)
        mapped.append(LayerEntries(entry.keys, entry.values, prompt, entry.counts, entry.log_weights, entry.spans))
    return mapped


@dataclass(frozen=True)
class Prebuilt:
    """A variant whose entries are already built (by its block-wise prefill): `engine.schedule.decode_variants`
    asks it for its counts and entries as it would ask a method."""

    entries: list

    def budgets(self, state, budget: int) -> np.ndarray:
        return np.array([[int(c) for c in entry.counts.tolist()] for entry in self.entries], dtype=np.int64)

    def compress(self, state, budget: int) -> list:
        return self.entries


def decode_blockwise(model, ids, state: PrefillState, reference, variants, decoding, memory, stops, block: int):
    """Every variant (`schedule.Variant`) prefilled block-wise on its own, then decoded from its own cache and its
    own first-token logits against the full cache's `reference` (`state`: the whole prompt's prefill, which the
    reference was decoded from). Returns (`schedule.Decoded`, `BlockwiseResult`) pairs in `variants`' order; the
    block-wise prefill is timed as the variant's build."""
    from ripplekv.engine.schedule import Variant, decode_variants

    done = []
    for variant in variants:
        with timings.phase(timings.BUILD, variant.label):
            result = blockwise_prefill(model, ids, variant.method, variant.budget, block,
                                       variant.method.requirements(), reserve=decoding.max_new_tokens)
        own = replace(state, last_logits=result.last_logits, memos={}, _full={})
        prebuilt = Variant(variant.label, variant.budget, Prebuilt(result.entries))
        [decoded] = decode_variants(model, own, reference, [prebuilt], decoding, memory, stops)
        done.append((replace(decoded, variant=variant), result))
        result.entries = None  # the pair keeps the figures, not the tensors
    return done
