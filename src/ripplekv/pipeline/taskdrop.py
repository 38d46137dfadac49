"""DepthKV's sensitivity as published: the drop in the task metric when one layer alone is pruned.

For a calibration sample with gold answers, the whole prompt is prefilled once. The full cache answers
greedily and is scored with its task's metric; then, for every layer l, a variant whose layer l alone
keeps the pruner's selection at the target ratio (DepthKV: H2O-like, 60% of the prompt pruned) while
every other layer stays full answers greedily too, and its drop is score(full) - score(pruned in l).
All variants share the prefill's keys and values: a pruned layer is a -inf key bias on the entries its
pruner evicts (a masked entry weighs exactly zero, as if removed), so no K/V is copied, and the
variants decode together in batches of `batch_size`.

As in `ripplekv eval`, the cache is pruned after the prefill and the first answer token comes from the
prefill, the same for every variant; the answer is scored exactly as eval scores it.
"""

from __future__ import annotations

import numpy as np
import torch

from ripplekv.engine.cache import VariantOverride
from ripplekv.engine.decode import greedy_decode, stop_tokens
from ripplekv.engine.prefill import prefill_for
from ripplekv.errors import UserError


def kept_count(length: int, prune_ratio: float) -> int:
    """Entries a pruned layer keeps per KV head: the rest after pruning `prune_ratio` of `length` (at least 1)."""
    return max(1, min(length, round((1.0 - prune_ratio) * length)))


def layer_prunes(pruner, state, count: int) -> torch.Tensor:
    """Bool masks [L, H_kv, n]: what each layer keeps when it alone is pruned to `count` entries per KV head, by
    the pruner's own selection. Every layer keeps exactly H_kv x `count` (a head split may move entries between
    a layer's heads, never between layers): the ratio a profile asks for holds in every layer, by construction
    (`profile.check_pruner` admits only pruners whose allocator gives every layer the same budget)."""
    keep = pruner.select(state, count)
    kept = keep.sum((1, 2)).tolist()
    expected = state.num_kv_heads * min(count, state.length)
    if any(int(k) != expected for k in kept):  # a pruner that spreads budgets over layers slipped past the check
        raise AssertionError(f"pruner {pruner.label} kept {kept} entries per layer, not {expected} in each")
    return keep


def eviction_bias(keep: torch.Tensor) -> torch.Tensor:
    """Additive key bias [H_kv, n]: 0 on kept entries, -inf on evicted ones."""
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))


def answers_with_layer_pruned(model, state, keep: torch.Tensor, layers: list[int], max_new_tokens: int, stops,
                              with_full: bool) -> list[list[int]]:
    """Greedy answers of variants that prune one layer each (`keep[l]`: the bool mask [H_kv, n] layer l keeps),
    the full cache's answer first when `with_full`; all from the one prefill in `state`."""
    offset = 1 if with_full else 0

    def prune(cache) -> None:
        for row, layer in enumerate(layers):
            cache.layers[layer].override = VariantOverride(row + offset, key_bias=eviction_bias(keep[layer]))

    return greedy_decode(model, state, None, max_new_tokens, stops, num_variants=len(layers) + offset, prepare=prune)


@torch.inference_mode()
def task_drop(model, tokenizer, prompt, pruner, prune_ratio: float, batch_size: int = 32) -> tuple[float, np.ndarray]:
    """(full cache's score, drop [L]) of one calibration sample: score(full) - score(layer l alone pruned)."""
    from ripplekv.metrics.scoring import score_sample
    from ripplekv.tasks.registry import task_named

    if prompt.task is None or not prompt.answers:
        raise UserError(f"calibration sample {prompt.sample_id} has no gold answers; the task-drop measure scores answers "
                        "(use --measure kl)")
    task = task_named(prompt.task)
    ids = list(prompt.context) + list(prompt.probe)
    state = prefill_for(model, ids, pruner.requirements(), reserve=task.max_new_tokens)
    keep = layer_prunes(pruner, state, kept_count(state.length, prune_ratio))
    stops = stop_tokens(model, tokenizer, task.stop_at_newline)

    def score(tokens: list[int]) -> float:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        return score_sample(task, text, prompt.answers, prompt.all_classes)

    layers = list(range(state.num_layers))
    scores: list[float] = []
    full = None
    for start in range(0, len(layers), batch_size):
        chunk = layers[start : start + batch_size]
        outputs = answers_with_layer_pruned(model, state, keep, chunk, task.max_new_tokens, stops, full is None)
        if full is None:
            full, outputs = score(outputs[0]), outputs[1:]
        scores.extend(score(tokens) for tokens in outputs)
    return full, full - np.asarray(scores, dtype=np.float64)
