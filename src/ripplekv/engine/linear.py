"""The model's linear layers on one to a few rows (a decoding step) at the cost of one read of the weights.

On a CPU, torch's `F.linear` on 2 to 4 rows took 2.0-2.3x as long as `W @ x^T` (the weight as stored, the rows
as its columns) in every shape of the bundled model, and 1.1-1.3x on 5 to 7 rows; on 8 and more they took the
same (torch 2.13, MKL; scripts/bench_linear.py). One row is a matrix-vector product, which MKL runs at about
half the memory bandwidth of its matrix product on this CPU, so one row goes in as two equal columns: a greedy
step of one sequence took 52 ms instead of 75. Divergence decoding runs most of its steps on 1 to 7 variants,
so each step costs about one weight read. The sums are the same products added in another order: the last bits
differ from `F.linear`'s. GPUs keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens over the whole batch) that go through `W @ x^T`: from 1 to FEW_ROWS.
FEW_ROWS = 7


class FewRowLinear(nn.Linear):
    """`nn.Linear` that computes 1 to `FEW_ROWS` rows on a CPU as `W @ x^T`; otherwise it is `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 1 <= rows <= FEW_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return by_columns(x, self.weight, self.bias)


def by_columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `weight @ x^T` (the rows of `x` as columns), contiguous; one row
    twice, as a matrix product (a copied row: a broadcast one takes a slower path and other sums)."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    out = torch.mm(weight, (torch.cat([rows, rows]) if single else rows).t())
    out = (out[:, :1] if single else out).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def few_row_linears(model) -> None:
    """Make each plain `nn.Linear` of `model` a `FewRowLinear` (the same weights, no copy); idempotent."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowLinear
