"""check-references for the cross-layer allocators: DynamicKV's and LAVa's layer budgets, re-implemented from
their code (DreamMr/DynamicKV `dynamic_v11.py`, MGDDestiny/Lava's model patch and `LavaKVCluster`, read, not
copied) on the reference venv's eager attention, against ours from the same prompt.

`signals` runs in the reference venv's attention hook (torch and numpy only): per layer DynamicKV's pooled
window scores (every query head) and LAVa's sparsity. `dynamickv_budgets` and `lava_budgets` apply each
reference's rule to them; `compare_allocators` reads both sides' files and prints one line per method:
the largest difference per layer (entries per head) over prompts and budgets.
"""

from __future__ import annotations

import math

import numpy as np

DYNAMICKV = {"window": 8, "kernel": 7, "radio_max": 10.0}  # avg pooling (the reference's Llama setting)
LAVA = {"window": 32, "kernel": 7}  # max pooling


def _pool(rows, kernel: int, kind: str):
    import torch.nn.functional as F

    pool = F.avg_pool1d if kind == "avg" else F.max_pool1d
    return pool(rows, kernel_size=kernel, padding=kernel // 2, stride=1)


def signals(layer: int, attentions, values, n: int) -> dict[str, np.ndarray]:
    """From one layer's eager attention [1, H_q, n, n] and values [1, H_kv, n, d]: DynamicKV's scores
    [H_q, n - w] (window rows summed, average-pooled) and LAVa's sparsity (its `calcul_attn_score`)."""
    import torch

    out = {}
    w = DYNAMICKV["window"]
    summed = attentions[:, :, -w:, : n - w].float().sum(-2)
    out[f"dynamickv_scores/{layer}"] = _pool(summed, DYNAMICKV["kernel"], "avg")[0].numpy()
    w = LAVA["window"]
    heads, kv_heads = attentions.shape[1], values.shape[1]
    mean = attentions[:, :, -w:, : n - w].float().mean(-2)
    pooled = _pool(mean, LAVA["kernel"], "max")  # [1, H_q, m]
    norms = values[..., : n - w, :].float().abs().sum(-1).amax(-1)  # [1, H_kv]
    pooled = pooled * torch.repeat_interleave(norms, heads // kv_heads, dim=1)[..., None]
    per_kv = pooled.view(1, kv_heads, heads // kv_heads, -1).amax(-2)
    flat = per_kv.flatten()
    probs = flat / (flat.sum() + 1e-16)
    entropy = float(-(probs * torch.log(probs + 1e-16)).sum())
    out[f"lava_sparsity/{layer}"] = np.asarray(entropy / math.log(flat.numel()))
    return out


def dynamickv_hits(scores: list[np.ndarray], budget: int, divide: bool = True) -> np.ndarray:
    """Per layer, how many of the global top `base x H x L` pooled scores it holds, integer-divided by L
    as `update_and_reset_budget` counts them (`divide=False`: the counts themselves)."""
    layers = len(scores)
    flat = np.concatenate([s.reshape(-1) for s in scores])
    top = np.argsort(-flat, kind="stable")[: (budget - DYNAMICKV["window"]) * scores[0].shape[0] * layers]
    counts = np.bincount(top // scores[0].size, minlength=layers)
    return counts // layers if divide else counts


def dynamickv_shares(scores: list[np.ndarray], budget: int, length: int) -> np.ndarray:
    """The same rule before its truncations (of the hits by L, of the budgets, the remainder on the last
    layer): window + L x base x the layer's share of the hits, real-valued, capped at `budget_size`."""
    w = DYNAMICKV["window"]
    base = budget - w
    counts = dynamickv_hits(scores, budget, divide=False)
    cap = min(int(DYNAMICKV["radio_max"] * base), length - w)
    return np.minimum(base * len(scores) * counts / counts.sum(), cap) + w


def dynamickv_budgets(scores: list[np.ndarray], budget: int, length: int) -> np.ndarray:
    """The reference's `update_and_reset_budget` at its last recomputation, over all L layers: the global
    top `base x H x L` of the pooled scores, hits per layer (integer-divided by L as it does), budgets
    `budget_size x share` truncated, rescaled to L x base, the remainder on the last layer, each capped at
    its `budget_size` prefix candidates; plus the window."""
    w = DYNAMICKV["window"]
    layers, base = len(scores), budget - w
    budget_size = min(int(DYNAMICKV["radio_max"] * base), length - w)
    counts = dynamickv_hits(scores, budget)
    shares = counts / counts.sum()
    fix = [int(budget_size * t) for t in shares]
    ratio = sum(fix) / (base * layers)
    fix = [int(k // ratio) for k in fix]
    fix[-1] += base * layers - sum(fix)
    return np.asarray([min(f, budget_size) for f in fix]) + w


def lava_budgets(sparsity: np.ndarray, budget: int) -> np.ndarray:
    """The reference's layer budgets: window + int(sparsity_l / sum x (B - w) x L)."""
    w = LAVA["window"]
    total = (budget - w) * len(sparsity)
    return np.asarray([int(s / sparsity.sum() * total) for s in sparsity]) + w


def compare_allocators(ours_files, reference_of, layers: int, budgets: list[int]) -> list[tuple[str, bool, str]]:
    """One line per method: max |ours - reference| per layer (entries per head) over prompts and budgets;
    `reference_of(ours_path)` opens the matching reference npz."""
    import json

    diffs = {"dynamickv": [], "lava": []}
    unrounded = []  # DynamicKV against its rule before the reference's truncations
    for ours_path in ours_files:
        ours, ref = np.load(ours_path), reference_of(ours_path)
        length = int(json.loads(str(ours["meta"]))["tokens"])
        for budget in budgets:
            theirs = dynamickv_budgets([ref[f"dynamickv_scores/{i}"] for i in range(layers)], budget, length)
            mine = ours[f"dynamickv/{budget}/counts"][:, 0]
            diffs["dynamickv"].append((np.abs(mine - theirs), int(theirs.sum()) - layers * budget))
            scores = [ref[f"dynamickv_scores/{i}"] for i in range(layers)]
            unrounded.append(float(np.abs(mine - dynamickv_shares(scores, budget, length)).max()))
            theirs = lava_budgets(np.asarray([float(ref[f"lava_sparsity/{i}"]) for i in range(layers)]), budget)
            mine = ours[f"lava/{budget}/counts"].sum(1) / ours[f"lava/{budget}/counts"].shape[1]
            diffs["lava"].append((np.abs(mine - theirs), int(theirs.sum()) - layers * budget))
    lines = []
    for name, values in diffs.items():
        per_layer = np.concatenate([d[0] for d in values])
        worst, last = float(per_layer.max()), float(max(d[0][-1] for d in values))
        text = (f"{name:<14} layer budgets vs its code's rule on the reference attention: max |diff| {worst:.2f} "
                f"entries per layer (last layer {last:.2f}); the reference's totals off by "
                f"{sorted({d[1] for d in values})} entries per head")
        ok = worst <= 1
        if name == "dynamickv":  # its two truncations and the remainder on its last layer move whole entries
            ok = max(unrounded) <= 1
            text += f"; vs the same rule before its truncations max |diff| {max(unrounded):.2f}"
        lines.append((name, ok, text))
    return lines
