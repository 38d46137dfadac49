"""check-references for the options that rewrite what a method keeps (key channels, merging, re-rotation), both
halves: what ours stores (`save_ours`, in the project's venv) and what kvpress's press returns on the same prompt
and weights (`reference_axes`, in the reference venv, one eager forward of its own), then `compare_axes`.

- `think`: our `snapkv:kernel=5:pooling=avg:think=0.5` at budget B keeps SnapKV's entries at the larger entry
  budget B' its bytes buy; kvpress's `SnapKVPress(32, 5)` at B' then `ThinKPress(0.5, window_size=32)` on what it
  kept (its `ComposedPress` order) zeroes channels: the kept channel sets per (layer, KV head) are compared.
- `merge=kvpress`: `MergingPress(SnapKVPress(32, 5))`'s merged values against ours at the same kept positions.
- `merge=cam`: `CAMPress(TOVAPress(), merge_budget=32)`'s `compress` (its eviction is one set per layer by the heads'
  mean, so the pair is `tova:merge=cam`, whose TOVA scores are the same in every head), given ours as its
  accumulated attention (the last 32 queries' attention, summed, averaged over the group), every evicted entry
  a merge candidate, and its Bernoulli draw replaced by its probability (ours merges in expectation).
- `rerotate`: `KeyRerotationPress(SnapKVPress(32, 5))`'s keys, at 0..c-1, rotated on by n - c with its own
  `_rerotate_cos_sin` (ours end at the prompt's last position), against ours.
- `blockwise`: `BlockPress(KeyDiffPress(), block_size=64)` against our per-block eviction (`engine.blockwise`'s
  `compress_read`, `keydiff:window=0`) on kvpress's own blocks of one full-attention prefill (the first B tokens
  kept, then blocks of 64 from there): the kept positions and keys. Our protocol reads each block through what was
  kept and counts blocks from the prompt's end (so the last is never shorter than a window); kvpress scores blocks
  of one prefill, which is what is compared here. KeyDiff reads keys alone; kvpress's SnapKV under BlockPress
  rotates each block's window queries with the RoPE of the prompt's last positions, so it has no pair here.
Values and keys count as identical within 1e-4 relative (float32 on both sides); re-rotated keys within 1e-4 plus
4 n 2^-24 (n: the prompt's tokens): each side rotates by angles up to n radians, twice, in float32, whose rounding
(|angle| 2^-24 each) moves a key's components by as much relative to the largest; the gap grows with the key's
position as that rounding does (measured at full size: at most 8.7e-05 below position 500, 1.8e-04 past 3000).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WINDOW = 32
KERNEL = 5
# name in the output -> our spec (the reference press is named in the module's docstring)
AXES = {
    "think": f"snapkv:kernel={KERNEL}:pooling=avg:think=0.5",
    "merge=kvpress": f"snapkv:kernel={KERNEL}:pooling=avg:merge=kvpress",
    "merge=cam": "tova:merge=cam",
    "rerotate": f"snapkv:kernel={KERNEL}:pooling=avg:rerotate=1",
    "blockwise": "keydiff:window=0",
}
BLOCK = 64  # BlockPress's block_size in the blockwise pair
TOLERANCE = 1e-4


def save_ours(state, out: Path, index: int, budgets: list[int], names) -> None:
    """What our specs store at each budget: think's kept channels (and B'), merged values, re-rotated keys."""
    import torch

    from ripplekv.methods import make_method

    arrays, meta = {}, {"entry_budgets": {}, "tokens": state.length, "budgets": budgets}
    with torch.no_grad():
        for name in names:
            method = make_method(AXES[name])
            for budget in budgets:
                if name == "think":
                    chosen = method.entry_budget(state, budget)
                    meta["entry_budgets"][str(budget)] = chosen
                    for layer, entries in enumerate(method.inner.compress(state, chosen)):
                        arrays[f"{name}/{budget}/{layer}/channels"] = method.channels.choose(state, layer, entries).numpy()
                    continue
                built = kvpress_blocks(state, method, budget) if name == "blockwise" else method.compress(state, budget)
                for layer, entries in enumerate(built):
                    arrays[f"{name}/{budget}/{layer}/positions"] = entries.positions.numpy()
                    tensor = entries.keys if name in ("rerotate", "blockwise") else entries.values
                    arrays[f"{name}/{budget}/{layer}/tensor"] = tensor.float().numpy()
    np.savez_compressed(out / f"axes_ours_{index}.npz", **arrays, meta=json.dumps({**meta, "names": list(names)}))


def kvpress_blocks(state, method, budget: int) -> list:
    """Our per-block eviction (`engine.blockwise.compress_read`) on BlockPress's blocks of the one prefill in `state`:
    the first `budget` tokens kept, then blocks of BLOCK tokens from there, each compressed with what was kept."""
    import torch

    from ripplekv.engine import entries
    from ripplekv.engine.blockwise import compress_read
    from ripplekv.engine.prefill import PrefillState

    heads, n = state.num_kv_heads, state.length
    kept = [entries.full(state.keys[layer][:, :budget], state.values[layer][:, :budget])
            for layer in range(state.num_layers)]
    for start in range(budget, n, BLOCK):
        block = torch.arange(start, min(start + BLOCK, n)).expand(heads, -1)
        positions = [torch.cat([entry.positions, block], dim=1) for entry in kept]
        width = state.keys[0].shape[-1]
        index = [where[..., None].expand(-1, -1, width) for where in positions]
        read = PrefillState(input_ids=torch.full((positions[0].shape[1],), -1), scaling=state.scaling,
                            keys=[state.keys[layer].gather(1, at) for layer, at in enumerate(index)],
                            values=[state.values[layer].gather(1, at) for layer, at in enumerate(index)],
                            last_logits=state.last_logits, model=state.model)
        kept = compress_read(read, method, budget, positions)
    return kept


def reference_axes(model, ids, out: Path, index: int) -> None:
    """kvpress's presses on prompt `index` (the reference venv): one eager forward, each press in a hook."""
    from unittest import mock

    import torch
    from check_references_worker import forward_with_hook, ratio
    from kvpress import (
        BlockPress,
        CAMPress,
        KeyDiffPress,
        KeyRerotationPress,
        MergingPress,
        SnapKVPress,
        ThinKPress,
        TOVAPress,
    )
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    meta = json.loads(str(np.load(out / f"axes_ours_{index}.npz")["meta"]))
    names, budgets, n = meta["names"], meta["budgets"], ids.shape[1]
    record = {}

    def snap():
        press = SnapKVPress(window_size=WINDOW, kernel_size=KERNEL)
        press.post_init_from_model(model)
        return press

    def hook(module, inputs, kwargs, output):
        layer = module.layer_idx
        cache = kwargs["past_key_values"].layers[layer]
        keys, values, hidden, attentions = cache.keys, cache.values, kwargs["hidden_states"], output[1]
        heads = keys.shape[1]
        for budget in budgets:
            key = f"{budget}/{layer}"
            if "think" in names:
                press = snap()
                press.compression_ratio = ratio("snapkv", meta["entry_budgets"][str(budget)], n, 0)
                kept_keys, kept_values = press.compress(module, hidden, keys, values, attentions, kwargs)
                pruned, _ = ThinKPress(0.5, window_size=WINDOW).compress(module, hidden, kept_keys.clone(), kept_values,
                                                                        attentions, kwargs)
                record[f"think/{key}/kept"] = pruned[0].abs().sum(1).gt(0).numpy()  # [H, d]
            if "merge=kvpress" in names:
                press = MergingPress(press=snap())
                press.compression_ratio = ratio("snapkv", budget, n, 0)
                order = press.press.score(module, hidden, keys, values, attentions, kwargs).topk(budget, dim=-1).indices
                _, merged = press.compress(module, hidden, keys, values, attentions, kwargs)
                record[f"merge=kvpress/{key}/positions"] = order[0].numpy()
                record[f"merge=kvpress/{key}/tensor"] = merged[0].float().numpy()
            if "merge=cam" in names:
                press = CAMPress(base_press=TOVAPress(), target_size=budget, merge_budget=32)
                press.post_init_from_model(model)
                group = attentions.shape[1] // heads
                mass = attentions[0, :, -WINDOW:, :].sum(1).view(heads, group, n).mean(1)[None]  # ours, as CaM's A
                press.layer_step_counts[layer] = n  # every evicted entry a merge candidate
                press._running_attn_sum[layer] = mass.clone()
                with mock.patch.object(torch, "bernoulli", lambda p: p):  # the draw's expectation, as ours
                    _, merged = press.compress(module, hidden, keys, values.clone(), mass, kwargs)
                mean = TOVAPress().score(module, hidden, keys, values, None, kwargs).mean(1)
                kept = mean.topk(budget, dim=-1).indices.sort(-1).values  # CAMPress's own kept set
                record[f"merge=cam/{key}/positions"] = kept.expand(heads, -1).numpy()
                record[f"merge=cam/{key}/tensor"] = merged[0].float().numpy()
            if "rerotate" in names:
                press = KeyRerotationPress(press=snap())
                press.compression_ratio = ratio("snapkv", budget, n, 0)
                order = press.press.score(module, hidden, keys, values, attentions, kwargs).topk(budget, dim=-1)
                positions = order.indices.sort(dim=2).values
                rotated, _ = press.compress(module, hidden, keys, values, attentions, kwargs)
                shift = (torch.arange(budget) - (n - budget)).expand(1, heads, budget)  # from 0..c-1 to n-c..n-1
                cos, sin = KeyRerotationPress._rerotate_cos_sin(rotated, module.rotary_emb.inv_freq, shift)
                record[f"rerotate/{key}/positions"] = positions[0].numpy()
                record[f"rerotate/{key}/tensor"] = (rotated * cos + rotate_half(rotated) * sin)[0].float().numpy()
            if "blockwise" in names:
                press = BlockPress(press=KeyDiffPress(), block_size=BLOCK)
                press.compression_ratio = ratio("keydiff", budget, n, 0)
                where = torch.arange(n, dtype=torch.float64)[None, None, :, None].expand_as(values)  # as values: the kept
                kept_keys, kept_at = press.compress(module, hidden, keys, where.contiguous(), None, kwargs)
                record[f"blockwise/{key}/positions"] = kept_at[0, :, :, 0].round().long().numpy()
                record[f"blockwise/{key}/tensor"] = kept_keys[0].float().numpy()
        return output

    forward_with_hook(model, ids, hook, "eager", DynamicCache)
    np.savez_compressed(out / f"axes_reference_{index}.npz", **record)


def compare_axes(out: Path, layers: int, budgets: list[int]) -> list[tuple[str, bool, str]]:
    """One line per option: the share of (layer, KV head, prompt, budget) where ours is kvpress's."""
    found = sorted(out.glob("axes_ours_*.npz"))
    if not found:
        return []
    names = json.loads(str(np.load(found[0])["meta"]))["names"]
    lines = []
    for name in names:
        same, worst, total, entry_budgets, longest = 0, 0.0, 0, set(), 0
        for path in found:
            ours, theirs = np.load(path), np.load(out / path.name.replace("axes_ours_", "axes_reference_"))
            meta = json.loads(str(ours["meta"]))
            longest = max(longest, meta["tokens"])
            for budget in budgets:
                for layer in range(layers):
                    key = f"{name}/{budget}/{layer}"
                    if name == "think":
                        entry_budgets.add(meta["entry_budgets"][str(budget)])
                        for head, kept in enumerate(theirs[f"{key}/kept"]):
                            same += set(np.flatnonzero(kept).tolist()) == set(ours[f"{key}/channels"][head].tolist())
                            total += 1
                        continue
                    for head in range(ours[f"{key}/positions"].shape[0]):
                        match, gap = _same_head(ours, theirs, key, head, tolerance(name, meta["tokens"]))
                        same, worst, total = same + match, max(worst, gap), total + 1
        extra = (f" at the entry budgets its bytes buy (B' = {','.join(map(str, sorted(entry_budgets)))})" if name == "think"
                 else f"; largest difference {worst:.2e} of the largest value (allowed {tolerance(name, longest):.1e})")
        what = "identical kept key channels" if name == "think" else "identical kept sets and tensors"
        lines.append((name, same / max(total, 1) >= 0.99,
                      f"{name:<14} ({AXES[name]}) {what} {same / max(total, 1):.4f} of {total} (layer, KV head, "
                      f"prompt, budget){extra}"))
    return lines


def tolerance(name: str, tokens: int) -> float:
    """The relative gap within which two tensors count as identical (see the module's docstring)."""
    return TOLERANCE + (4 * tokens * 2.0**-24 if name == "rerotate" else 0.0)


def _same_head(ours, theirs, key: str, head: int, within: float) -> tuple[bool, float]:
    """Whether one head kept the same positions with the same tensor rows (within `within` of its largest)."""
    mine = ours[f"{key}/positions"][head]
    count = int((mine >= 0).sum())
    mine = mine[:count]
    other = theirs[f"{key}/positions"][head]
    if sorted(mine.tolist()) != sorted(other.tolist()):
        return False, 0.0
    a = ours[f"{key}/tensor"][head][:count][np.argsort(mine)]
    b = theirs[f"{key}/tensor"][head][np.argsort(other)]
    scale = max(float(np.abs(b).max()), 1e-12)
    gap = float(np.abs(a - b).max()) / scale
    return gap <= within, gap
