"""check-references for the chunk-level selections (ChunkKV, its entropy gate, ChunkPress) and LagKV.

Our side runs the specs in `CHUNK_PAIRS` like every pair; the reference side (`check_references_worker`'s eager
hook) runs kvpress's own presses on the same layer:
- `ChunkKVPress(SnapKVPress(32, 5), 20)` against `chunkkv:kernel=5:pooling=avg:chunk_rounding=kvpress` (kvpress's
  count of whole chunks at ratio 1 - B/n; our default keeps exactly B, printed beside for information);
- `EntropyGatedChunkKVPress(ExpectedAttentionPress())` (chunks of 10, spiky ones cut to 4: its defaults) against
  `eg-chunkkv:scorer=expected-attention:window=0` (exact counts on both sides);
- `ChunkPress(KnormPress(), 1024)` against `chunkpress:scorer=knorm:chunk_rounding=kvpress`: KNorm scores one key
  at a time, so scoring each segment alone (kvpress) and the whole prompt (ours) give the same scores;
- `LagKVPress()` against `lagkv` (ranks tie across partitions by design: its scores are recorded to tell them apart).
The wrapper presses ask their inner press for scores on the keys and values they are handed; the hook hands them
positions in place of the values (as for every scorer press) and the inner press's `score` is redirected to the
real values at those positions. They refuse attention maps, so they get none (SnapKV computes its window's).
"""

from __future__ import annotations

from check_references_worker import KERNEL, WINDOW, kept_by_compress, padded

CHUNK_PAIRS = {
    "chunkkv:chunk_rounding=kvpress": (f"chunkkv:kernel={KERNEL}:pooling=avg:chunk_rounding=kvpress", "chunkkv"),
    "eg-chunkkv (expected-attention)": ("eg-chunkkv:scorer=expected-attention:window=0", "egchunkkv"),
    "chunkpress (knorm)": ("chunkpress:scorer=knorm:chunk_rounding=kvpress", "chunkpress"),
    "lagkv": ("lagkv", "lagkv"),
}
# Ours at exact budgets against the same presses, for information (whole chunks cannot add up to B exactly).
CHUNK_EARLIER = {
    "chunkkv (exact count)": (f"chunkkv:kernel={KERNEL}:pooling=avg", "chunkkv"),
    "chunkpress:scorer=knorm (exact count)": ("chunkpress:scorer=knorm", "chunkpress"),
}
WRAPPERS = ("chunkkv", "egchunkkv", "chunkpress")
WHOLE_CHUNKS = ("chunkkv", "chunkpress")  # kvpress's own count of chunks or segments: compared at ratio 1 - B/n


def chunk_presses() -> dict:
    """The presses of `CHUNK_PAIRS`, by their key in the worker's output."""
    from kvpress import (
        ChunkKVPress,
        ChunkPress,
        EntropyGatedChunkKVPress,
        ExpectedAttentionPress,
        KnormPress,
        LagKVPress,
        SnapKVPress,
    )

    return {"chunkkv": ChunkKVPress(SnapKVPress(window_size=WINDOW, kernel_size=KERNEL), chunk_length=20),
            "egchunkkv": EntropyGatedChunkKVPress(ExpectedAttentionPress()),
            "chunkpress": ChunkPress(KnormPress(), chunk_length=1024),
            "lagkv": LagKVPress()}


def chunk_ratio(name: str, budget: int, n: int) -> float | None:
    """The compression ratio the presses that keep whole chunks are compared at (None: the worker's usual one). Our
    `chunk_rounding=kvpress` reads the same ratio from B and n, in the same floating-point steps."""
    return 1 - budget / n if name in WHOLE_CHUNKS else None


def kept_by_wrapper(press, module, hidden, keys, values, kwargs):
    """The positions a wrapper press keeps: positions in place of the values, its inner press scoring the real values
    at the positions it is handed (ChunkPress hands it one segment at a time)."""
    import torch

    n = keys.shape[2]
    positions = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand_as(values).contiguous()
    inner = press.press
    score = inner.score

    def on_real_values(m, h, k, v, a, kw):
        return score(m, h, k, values[:, :, v[0, 0, :, 0].round().long()], a, kw)

    inner.score = on_real_values
    try:
        _, kept = press.compress(module, hidden, keys, positions, None, kwargs)
    finally:
        del inner.score
    return padded(list(kept[0, :, :, 0].round().long().numpy()))


def kept_by_chunk_press(name, press, module, hidden, keys, values, attentions, kwargs):
    """`kept_by_wrapper` for the wrappers, the worker's `kept_by_compress` for LagKV."""
    if name in WRAPPERS:
        return kept_by_wrapper(press, module, hidden, keys, values, kwargs)
    return kept_by_compress(press, module, hidden, keys, values, attentions, kwargs)


def chunk_scores(presses: dict, module, hidden, keys, values, kwargs, layer: int) -> dict:
    """The scores that tell tied entries apart: LagKV's ranks, KNorm's under ChunkPress; of those among `presses`
    (`--only` runs some of them alone)."""
    record = {}
    if "lagkv" in presses:
        record[f"lagkv_scores/{layer}"] = presses["lagkv"].score(module, hidden, keys, values, None, kwargs)[0].float().numpy()
    if "chunkpress" in presses:
        record[f"chunkpress_scores/{layer}"] = -keys[0].float().norm(dim=-1).numpy()
    return record
