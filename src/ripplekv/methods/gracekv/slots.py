"""GraceKV's slots: boundary scores from the trajectory's curvature, and the dynamic program that cuts slots.

Curvature at token i for a window w: kappa_i = 1 - cos(x_i - mean(x_{i-w..i-1}), mean(x_{i+1..i+w}) - x_i), the
turn the trajectory takes at i (0 where a window would leave the prompt). It is taken for every layer and
every w in `widths`, stabilised as mean - spread x std over those, and robust-z-scored (median, 1.4826 MAD).
A high score at i says a slot should start at i.

The trajectory: the paper uses hidden states. The prefill keeps each layer's values, and a layer's values
(all KV heads side by side) are a fixed linear map of its normalised input hidden state, so we take those
(no new prefill signal; a linear map keeps "moves along a line" but not angles exactly: our choice, said here).
The paper's second term, lambda_s x the token's robust-z surprisal, needs every prompt token's next-token
log-probability, which the prefill does not record (it keeps the last logits only); it is left out.

Slots: the compressible tokens are cut into slots of `min_slot..max_slot` tokens maximising the boundary
scores at the slot starts (the first slot's start is not a cut) less `shape` x ((length - slot) / slot)^2
per slot, by an exact O(m x (max_slot - min_slot)) dynamic program (`segment`).
"""

from __future__ import annotations

import numpy as np
import torch

from ripplekv.engine.prefill import PrefillState


def curvature(trajectory: torch.Tensor, width: int) -> torch.Tensor:
    """kappa [n] of one trajectory [n, D] (float32) for window `width`; 0 where a window leaves the prompt."""
    n = trajectory.shape[0]
    out = torch.zeros(n, device=trajectory.device)
    if n < 2 * width + 1:
        return out
    cum = torch.cat([torch.zeros_like(trajectory[:1]), trajectory.cumsum(0)])  # cum[j] = sum of x_0..x_{j-1}
    i = torch.arange(width, n - width, device=trajectory.device)
    past = (cum[i] - cum[i - width]) / width
    future = (cum[i + width + 1] - cum[i + 1]) / width
    incoming, outgoing = trajectory[i] - past, future - trajectory[i]
    out[i] = 1 - torch.nn.functional.cosine_similarity(incoming, outgoing, dim=-1, eps=1e-12)
    return out


def robust_z(x: torch.Tensor) -> torch.Tensor:
    """(x - median) / (1.4826 MAD), with the MAD floored so a flat signal gives zeros, not infinities."""
    median = x.median()
    mad = (x - median).abs().median() * 1.4826
    return (x - median) / mad.clamp(min=1e-6 * (x.abs().max() + 1e-12))


def boundary_scores(state: PrefillState, widths, spread: float) -> torch.Tensor:
    """Robust-z boundary score [n] per prompt token (cached per prompt)."""
    def compute() -> torch.Tensor:
        kappas = []
        for values in state.values:  # [H_kv, n, d]
            trajectory = values.float().transpose(0, 1).reshape(values.shape[1], -1)
            kappas.extend(curvature(trajectory, int(w)) for w in widths)
        stacked = torch.stack(kappas)
        return robust_z(stacked.mean(0) - spread * stacked.std(0, unbiased=False))

    return state.memo((boundary_scores, tuple(widths), spread), compute)


def segment(scores, lo: int, hi: int, target: int, shape: float) -> list[int]:
    """Slot starts (0 first) cutting len(scores) tokens into slots of lo..hi tokens, maximising
    sum of scores[start] over the starts after the first, less shape x ((length - target) / target)^2 per slot.

    Fewer than `lo` tokens make one slot. Ties go to the shorter last slot (the first maximum of each step).
    """
    scores = np.asarray(scores, dtype=np.float64)
    m = len(scores)
    if m <= lo:
        return [0] if m else []
    lengths = np.arange(lo, hi + 1)
    penalty = shape * ((lengths - target) / target) ** 2
    best = np.full(m + 1, -np.inf)
    best[0] = 0.0
    back = np.zeros(m + 1, dtype=np.int64)
    gain = np.concatenate([[0.0], scores[1:]])  # a slot starting at 0 is not a cut
    for end in range(lo, m + 1):
        starts = end - lengths
        ok = starts >= 0
        if not ok.any():
            continue
        cand = np.where(ok, best[np.maximum(starts, 0)] + gain[np.maximum(starts, 0)] - penalty, -np.inf)
        pick = int(np.argmax(cand))
        best[end], back[end] = cand[pick], starts[pick]
    if not np.isfinite(best[m]):  # lengths that cannot be cut (only when hi < 2 lo - 1): one slot
        return [0]
    cuts, at = [], m
    while at > 0:
        at = int(back[at])
        cuts.append(at)
    return cuts[::-1]


def segment_value(scores, starts: list[int], target: int, shape: float) -> float:
    """The objective `segment` maximises, for given starts (used to check it)."""
    ends = [*starts[1:], len(scores)]
    return float(sum(scores[s] for s in starts[1:]) - sum(shape * ((e - s - target) / target) ** 2
                                                          for s, e in zip(starts, ends)))


def slot_of_tokens(state: PrefillState, sinks: int, window: int, opts) -> torch.Tensor:
    """Slot index [n_c] of every compressible token (positions sinks..n - window - 1), cached per prompt."""
    n = state.length
    def compute() -> torch.Tensor:
        scores = boundary_scores(state, opts.widths, opts.spread)[sinks : n - window]
        starts = segment(scores.cpu().numpy(), opts.min_slot, opts.max_slot, opts.slot, opts.shape)
        marks = torch.zeros(n - window - sinks, dtype=torch.long)
        marks[starts[1:]] = 1
        return marks.cumsum(0).to(state.device)

    key = (slot_of_tokens, sinks, window, opts.widths, opts.spread, opts.min_slot, opts.max_slot, opts.slot, opts.shape)
    return state.memo(key, compute)
