"""KVzap's surrogate: one small model per layer from the layer's attention input [n, D] to log scores [n, H_kv].

The shapes are kvpress's `KVzapModel` (read, not copied): `linear` is D -> H_kv; `mlp` is D -> D/8 -> GELU ->
H_kv. A linear surrogate is fitted in closed form (ridge regression, as the paper's code fits it with
scikit-learn's `Ridge`); an MLP by AdamW on the mean squared error with a cosine learning rate and gradient
clipping (the paper's code: lr 5e-3, batch 512, clip 1.0). Both see inputs and targets in float32.

Weights are stored as safetensors under kvpress's parameter names (`layers.{i}.weight` for a linear layer,
`layers.{i}.0.*` and `layers.{i}.2.*` for an MLP), in float16 to keep the shipped files small, with the
provenance as JSON beside them; the scorer and kvpress's `KVzapModel` (make check-references) load the same
numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ripplekv.errors import UserError
from ripplekv.methods.core import fitted_weights

KINDS = ("mlp", "linear")
HIDDEN_SHARE = 8  # the MLP's hidden width is D / 8 (kvpress's published surrogates)


def build(kind: str, input_dim: int, output_dim: int, layers: int) -> nn.ModuleList:
    """The untrained surrogate: one module per layer, kvpress's shapes."""
    if kind not in KINDS:
        raise UserError(f"option model must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "linear":
        return nn.ModuleList(nn.Linear(input_dim, output_dim) for _ in range(layers))
    hidden = max(input_dim // HIDDEN_SHARE, 1)
    return nn.ModuleList(nn.Sequential(nn.Linear(input_dim, hidden), nn.GELU(), nn.Linear(hidden, output_dim))
                         for _ in range(layers))


def fit_linear(inputs: torch.Tensor, targets: torch.Tensor, alpha: float = 1.0) -> nn.Linear:
    """Ridge regression of targets [N, H] on inputs [N, D] with an unpenalised intercept (scikit-learn's `Ridge`
    with its default alpha 1), solved exactly in float64."""
    x, y = inputs.double(), targets.double()
    x_mean, y_mean = x.mean(0), y.mean(0)
    xc, yc = x - x_mean, y - y_mean
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=torch.float64)
    weight = torch.linalg.solve(gram, xc.T @ yc)  # [D, H]
    layer = nn.Linear(x.shape[1], y.shape[1])
    with torch.no_grad():
        layer.weight.copy_(weight.T.float())
        layer.bias.copy_((y_mean - x_mean @ weight).float())
    return layer


def fit_mlp(inputs: torch.Tensor, targets: torch.Tensor, epochs: int = 15, lr: float = 5e-3, batch: int = 512,
            seed: int = 0) -> nn.Sequential:
    """The MLP surrogate of one layer trained on (inputs [N, D], targets [N, H]): AdamW, MSE, cosine schedule,
    gradient norm clipped at 1 (the paper's code's settings), deterministic under `seed`. The output bias starts at
    the targets' mean, which a few calibration prompts' worth of steps could not otherwise reach."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = build("mlp", inputs.shape[1], targets.shape[1], 1)[0]
    x, y = inputs.float(), targets.float()
    with torch.no_grad():  # start from the targets' mean (log scores sit far from 0), not from a random offset
        module[2].bias.copy_(y.mean(0))
    steps = max(epochs * math.ceil(len(x) / batch), 1)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch):
            pick = order[start:start + batch]
            loss = nn.functional.mse_loss(module(x[pick]), y[pick])
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    return module.eval()


def fit(kind: str, inputs: list[torch.Tensor], targets: list[torch.Tensor], epochs: int = 15) -> nn.ModuleList:
    """A surrogate of `kind` fitted layer by layer on per-layer (inputs [N, D], targets [N, H])."""
    if kind == "linear":
        return nn.ModuleList(fit_linear(x, y) for x, y in zip(inputs, targets))
    return nn.ModuleList(fit_mlp(x, y, epochs=epochs, seed=layer) for layer, (x, y) in enumerate(zip(inputs, targets)))


def predict(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Log scores [H, n] (float32) of the entries whose attention inputs are `hidden` [n, D]."""
    with torch.inference_mode():  # the prefill's hidden states are inference tensors
        return module.to(hidden.device).float()(hidden.float()).T.contiguous()


FIT = "ripplekv fit kvzap --out DIR, then pass kvzap:weights=DIR/kvzap-MODEL.safetensors"


def save(path: str | Path, kind: str, layers: nn.ModuleList, provenance: dict) -> Path:
    """The weights (float16, kvpress's parameter names) and `path`.json with the shapes and `provenance`."""
    tensors = {f"layers.{name}": value.to(torch.float16) for name, value in layers.state_dict().items()}
    first = layers[0] if kind == "linear" else layers[0][0]
    last = layers[0] if kind == "linear" else layers[0][2]
    shape = {"surrogate": kind, "input_dim": first.in_features, "output_dim": last.out_features,
             "hidden_dim": None if kind == "linear" else first.out_features, "n_modules": len(layers)}
    return fitted_weights.save(path, tensors, {**shape, **provenance})


def load(path: str | Path) -> tuple[nn.ModuleList, dict]:
    """(surrogate in float32, its provenance) from a weights file; every problem is one line naming the file."""

    def build_from(info: dict, tensors: dict) -> nn.ModuleList:
        layers = build(info["surrogate"], int(info["input_dim"]), int(info["output_dim"]), int(info["n_modules"]))
        layers.load_state_dict({name[len("layers."):]: value for name, value in tensors.items()})
        return layers.eval()

    return fitted_weights.load(path, "KVzap weights", FIT, build_from)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation of two score vectors (the held-out fit the provenance reports)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)
