"""The model's linear layers on a few rows (a decoding step of a handful of variants) at about one row's cost.

On a CPU, torch's `F.linear` on 2 to 4 rows took 2.0-2.3x as long as `W @ x^T` (the weight as stored, the rows
as its columns) in every shape of the bundled model, and 1.1-1.3x on 5 to 7 rows; on one row or on 8 and more
they took the same (torch 2.13, MKL; scripts/bench_linear.py). Divergence decoding runs most of its steps on
2 to 7 variants, so there each step costs about one weight read instead of two or three. The sums are the same
products added in another order: the last bits differ, as between any two batch sizes. GPUs keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens over the whole batch) that go through `W @ x^T`: from 2 to FEW_ROWS.
FEW_ROWS = 7


class FewRowLinear(nn.Linear):
    """`nn.Linear` that computes 2 to `FEW_ROWS` rows on a CPU as `W @ x^T`; otherwise it is `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 2 <= rows <= FEW_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return by_columns(x, self.weight, self.bias)


def by_columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `weight @ x^T` (the rows of `x` as columns), contiguous."""
    out = torch.mm(weight, x.reshape(-1, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def few_row_linears(model) -> None:
    """Make each plain `nn.Linear` of `model` a `FewRowLinear` (the same weights, no copy); idempotent."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowLinear
