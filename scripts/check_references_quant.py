"""check-references for the KIVI quantizer: our quantize-dequantize against optimum-quanto's affine group quantizer.

KIVI's own repository is not installable here, so the reference is optimum-quanto (the quantizer transformers'
`QuantizedCache` uses), run in the reference venv on the very K/V our prefill made (float32: the bundled model's
dtype, so minimum and scale are stored at float32 on both sides). Its `MaxOptimizer` takes a group's minimum and
maximum, scale = (max - min) / (2^bits - 1) and a float shift = -min; `quantize_affine` stores
round((x + shift) / scale) clamped to [0, 2^bits - 1] and `dequantize` returns level x scale - shift: KIVI's
asymmetric scheme. Its groups are `group` consecutive numbers of one row of a 2-D tensor (axis 0), so keys go in
as [channels, tokens] rows (KIVI's per-channel groups of tokens) and values as [tokens, channels] rows (per-token
groups of channels). What differs: quanto's affine path is 2 and 4 bits only (its 8 bits are symmetric), so 8 is
not compared; it needs whole groups, so our last, partial key group (ours quantizes it on its own, see
`ripplekv.engine.quantize`) goes in as its own group of that length; the residual (the last RESIDUAL entries,
untouched by design) is left out and checked to be untouched.

A number is *identical within the reference's rounding* when both sides chose the same level: |ours - theirs| is
below half a quantization step (`group_steps`), so what is left is float rounding of min + level x scale; the
exact share and the largest difference in steps are printed beside it (`agreement`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BITS = (2, 4)  # quanto's affine (min/scale) quantizer: qint2 and qint4
GROUP = 32  # KIVI's LongBench setting
RESIDUAL = 128  # KIVI's LongBench setting: the last 128 entries stay at full precision


def kv_path(out: Path, index: int) -> Path:
    return out / f"kv_prompt_{index}.npy"


def save_kv(state, out: Path, index: int) -> None:
    """(our side) The prefill's K/V as float32 [L, 2, H_kv, n, d] for the worker to quantize with quanto."""
    import torch

    kv = torch.stack([torch.stack([k.float(), v.float()]) for k, v in zip(state.keys, state.values)])
    np.save(kv_path(out, index), kv.numpy())


# --------------------------------------------------------------------------- reference side (quanto)


def quanto_rows(rows, bits: int, group: int):
    """(reference venv) optimum-quanto's affine quantize-dequantize of a 2-D float tensor in groups of `group`
    consecutive numbers along each row (its axis 0); a row length that `group` does not divide ends in a group
    of its own (quanto needs whole groups)."""
    import torch
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    qtype = {2: qint2, 4: qint4}[bits]
    whole = rows.shape[1] // group * group
    parts = []
    for start, stop, size in ((0, whole, group), (whole, rows.shape[1], rows.shape[1] - whole)):
        if stop > start:
            part = rows[:, start:stop].contiguous()
            scale, shift = MaxOptimizer()(part, qtype=qtype, axis=0, group_size=size)
            quantized = quantize_weight(part, qtype=qtype, axis=0, scale=scale, shift=shift, group_size=size,
                                        optimized=False)
            parts.append(quantized.dequantize())
    return torch.cat(parts, dim=1)


def reference_dequantized(out: Path) -> None:
    """(reference venv) For every kv_prompt_*.npy: quanto's dequantized keys (per channel) and values (per token)
    of every entry but the last RESIDUAL, at each of BITS, saved as quanto_prompt_*.npz ([L, H, m, d] each)."""
    import torch

    for path in sorted(out.glob("kv_prompt_*.npy")):
        kv = torch.from_numpy(np.load(path))
        layers, _, heads, n, d = kv.shape
        m = max(n - RESIDUAL, 0)
        record = {}
        for bits in BITS:
            keys, values = [], []
            for layer in range(layers):
                k, v = kv[layer, 0, :, :m], kv[layer, 1, :, :m]
                rows = quanto_rows(k.transpose(-1, -2).reshape(heads * d, m), bits, GROUP)
                keys.append(rows.reshape(heads, d, m).transpose(-1, -2))
                values.append(quanto_rows(v.reshape(heads * m, d), bits, GROUP).reshape(heads, m, d))
            record[f"keys/{bits}"] = torch.stack(keys).numpy()
            record[f"values/{bits}"] = torch.stack(values).numpy()
        np.savez(out / f"quanto_{path.stem[len('kv_'):]}.npz", **record)


# --------------------------------------------------------------------------- the comparison (our side)


def group_steps(x: np.ndarray, group: int, bits: int) -> np.ndarray:
    """Each number's quantization step, (max - min) / (2^bits - 1) of its group of `group` consecutive numbers
    along the last axis (a last, shorter group on its own), in float32 as both sides compute it."""
    x = np.asarray(x, dtype=np.float32)
    steps = np.empty_like(x)
    levels = np.float32(2**bits - 1)
    for start in range(0, x.shape[-1], group):
        part = x[..., start:start + group]
        steps[..., start:start + group] = (part.max(-1, keepdims=True) - part.min(-1, keepdims=True)) / levels
    return steps


def agreement(ours: np.ndarray, theirs: np.ndarray, steps: np.ndarray) -> dict:
    """How two dequantizations of the same numbers agree: `numbers`, `exact` (bitwise equal), `same_level`
    (|ours - theirs| < half the number's step, or equal where the step is 0: the same quantization level, up to
    float rounding) and `max_steps` (the largest difference in steps; 0 where every step is 0 and all equal)."""
    diff = np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(theirs, dtype=np.float64))
    steps = np.asarray(steps, dtype=np.float64)
    same = np.where(steps > 0, diff < steps / 2, diff == 0)
    in_steps = np.where(steps > 0, diff / np.where(steps > 0, steps, 1), np.where(diff == 0, 0, np.inf))
    return {"numbers": int(diff.size), "exact": int((diff == 0).sum()), "same_level": int(same.sum()),
            "max_steps": float(in_steps.max()) if diff.size else 0.0}


def merged(parts: list[dict]) -> dict:
    total = {key: sum(p[key] for p in parts) for key in ("numbers", "exact", "same_level")}
    total["max_steps"] = max((p["max_steps"] for p in parts), default=0.0)
    return total


def compare_quantizers(out: Path, version: str) -> list[tuple[str, bool, str]]:
    """One line per bit width: the shares of our dequantized keys and values (every prompt and layer, residual
    excluded) identical within quanto's rounding, exactly equal, and the worst difference in steps; and whether
    our residual came back untouched."""
    import torch

    from ripplekv.engine.quantize import QuantSpec, quantize_head

    tallies = {(bits, part): [] for bits in BITS for part in ("keys", "values")}
    untouched = True
    for path in sorted(out.glob("kv_prompt_*.npy")):
        kv = np.load(path)
        theirs = np.load(out / f"quanto_{path.stem[len('kv_'):]}.npz")
        m = max(kv.shape[3] - RESIDUAL, 0)
        for bits in BITS:
            spec = QuantSpec(bits=bits, group=GROUP, residual=RESIDUAL)
            for layer in range(kv.shape[0]):
                keys, values = (torch.from_numpy(kv[layer, i]) for i in (0, 1))
                our_keys, our_values = (t.numpy() for t in quantize_head(keys, values, spec))
                untouched &= bool((our_keys[:, m:] == kv[layer, 0, :, m:]).all()
                                  and (our_values[:, m:] == kv[layer, 1, :, m:]).all())
                key_steps = group_steps(np.swapaxes(kv[layer, 0, :, :m], -1, -2), GROUP, bits).swapaxes(-1, -2)
                tallies[bits, "keys"].append(agreement(our_keys[:, :m], theirs[f"keys/{bits}"][layer], key_steps))
                tallies[bits, "values"].append(agreement(our_values[:, :m], theirs[f"values/{bits}"][layer],
                                                         group_steps(kv[layer, 1, :, :m], GROUP, bits)))
    lines = []
    for bits in BITS:
        keys, values = merged(tallies[bits, "keys"]), merged(tallies[bits, "values"])
        both = merged([keys, values])
        share = both["same_level"] / max(both["numbers"], 1)
        name = f"kivi:bits={bits}"
        lines.append((name, share >= 0.99 and untouched and both["numbers"] > 0,
                      f"{name:<14} identical within quanto's rounding (same level) {share:.4f} of {both['numbers']} "
                      f"K/V numbers (keys per channel {keys['same_level'] / max(keys['numbers'], 1):.4f}, values per "
                      f"token {values['same_level'] / max(values['numbers'], 1):.4f}); bitwise equal "
                      f"{both['exact'] / max(both['numbers'], 1):.4f}; max diff {both['max_steps']:.3g} steps; "
                      f"vs optimum-quanto {version} affine qint{bits}, group {GROUP}, float32 min/scale, residual "
                      f"{RESIDUAL} excluded (untouched: {untouched})"))
    return lines
