"""The representation predictor of layer sensitivity: InfoNCE of each layer's pooled representations.

After Skean et al. (2025, "Layer by Layer"), whose augmentation-invariance metric DepthKV reports as a
predictor of its task-drop sensitivity. Every calibration prompt is read twice, each time as a different
view of the same text; a layer's representation of a view is its output hidden states mean-pooled over
the tokens. With z_i and z'_i the two views of prompt i (L2-normalised), the layer's InfoNCE loss is

    loss = mean_i [ -log softmax_j(z_i . z'_j / tau)_i ],   over the N calibration prompts,

and Skean et al.'s normalised form, a lower bound on the mutual information between the views in units
of log N, is 1 - loss / log N: higher means the layer tells prompts apart whatever the perturbation.

Ours, where the definition leaves a choice: a view drops an independent random `drop` share of the
prompt's tokens (seeded by the prompt's index; Skean et al. use text augmentations), tau = 0.1 (as
their code), and the cosine similarity (normalised representations). Per prompt we keep its term of
the mean (`anchor_losses`), so a profile's per-sample table and split-half check work as for the others.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ripplekv.engine import adapter

TEMPERATURE = 0.1
DROP = 0.1


def view_ids(ids: list[int], drop: float, seed: int) -> list[int]:
    """The prompt with a random `drop` share of its tokens removed (the first token, often BOS, always kept)."""
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(len(ids), generator=generator) >= drop
    keep[0] = True
    return [token for token, kept in zip(ids, keep.tolist()) if kept]


@torch.inference_mode()
def pooled_layers(model, ids: list[int]) -> np.ndarray:
    """[L, d] float32: each decoder layer's output hidden states averaged over the tokens of `ids`.

    Hooks pool each layer as the forward pass goes, so no [L, n, d] stack of hidden states is kept."""
    pooled: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        pooled.append(hidden[0].float().mean(0))

    handles = [layer.register_forward_hook(hook) for layer in adapter.decoder_layers(model)]
    try:
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(pooled).cpu().numpy()


def prompt_views(model, ids: list[int], index: int, drop: float = DROP) -> np.ndarray:
    """[2, L, d]: the pooled layers of prompt number `index`'s two views."""
    return np.stack([pooled_layers(model, view_ids(ids, drop, 2 * index + view)) for view in (0, 1)])


def anchor_losses(views: np.ndarray, temperature: float = TEMPERATURE) -> np.ndarray:
    """[N, L]: prompt i's InfoNCE term -log softmax_j(z_i . z'_j / tau)_i at each layer; `views` [N, 2, L, d].

    Their mean over the prompts is the layer's InfoNCE loss. Float64 throughout (a tiny N is common)."""
    z = np.asarray(views, dtype=np.float64)
    z = z / np.maximum(np.linalg.norm(z, axis=-1, keepdims=True), 1e-12)
    first, second = z[:, 0].transpose(1, 0, 2), z[:, 1].transpose(1, 0, 2)  # [L, N, d]
    logits = first @ second.transpose(0, 2, 1) / temperature  # [L, N, N]: anchor i against every second view j
    top = logits.max(-1, keepdims=True)
    log_norm = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    diagonal = np.diagonal(logits, axis1=1, axis2=2)
    return (log_norm - diagonal).T


def mutual_information_bound(loss: np.ndarray, prompts: int) -> np.ndarray:
    """Skean et al.'s normalised InfoNCE, 1 - loss / log N (N prompts; undefined for one prompt: NaN)."""
    loss = np.asarray(loss, dtype=np.float64)
    return 1.0 - loss / math.log(prompts) if prompts > 1 else np.full_like(loss, np.nan)
