"""FastKVzip's gate: one per layer, from an entry's attention input [n, D] to a score in (0, 1) per KV head.

The form is kvpress's `FastKVzipGate` (Kim, Han & Yun, arXiv 2601.17668; read, not copied), the "low-rank sink
attention": the hidden state is projected to `group` queries (with a bias) and one key per KV head, each of
`dim` (16) channels and RMS-normed with a learned scale; the entry's key competes with `sinks` (16) learned keys
for each of its own queries, so a query's score is exp(l) / (exp(l) + sum_s exp(l_s)) with l = q.k / sqrt(dim)
+ b and l_s = q.k_s / sqrt(dim), and the head's score is the mean over its `group` queries. Scoring follows the
press's arithmetic step for step (the same float32 numbers for make check-references).

Fitting (`fit`): the authors' `optim.py` (FastKVzip repository) trains every layer on the binary cross-entropy
between the gate's score and KVzip's score (mean over entries, summed over heads) by SGD with momentum 0.9, lr
0.2, batches of 1000 entries, 5000 steps, the rate halved at half the steps and halved again at three quarters.
We do the same, one layer at a time (their loss is a sum over layers, so the layers' updates are independent),
with a linear warm-up over the first 1% of the steps (theirs ramps to 0.49 and then jumps to 1) and the last
batch of a pass kept rather than dropped. kvpress says nothing of training; it only loads the hub's gates.
Weights are stored under the press's parameter names (`layers.{i}.q_proj.weight`, ...) in float16
(`core.fitted_weights`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ripplekv.methods.core import fitted_weights

DIM, SINKS, EPS = 16, 16, 1e-6  # the published gates' `dim16_sink16`; Qwen3RMSNorm's epsilon
LR, BATCH, STEPS, MOMENTUM = 0.2, 1000, 5000, 0.9  # the authors' optim.py
FIT = "ripplekv fit fastkvzip --model M --out DIR, then pass fastkvzip:weights=DIR/fastkvzip.safetensors"


class ScaledRMSNorm(nn.Module):
    """x / rms(x) x a learned scale per channel, in float32 (Qwen3RMSNorm's arithmetic)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


class Gate(nn.Module):
    """One layer's gate: attention inputs [n, D] -> scores [H_kv, n] in (0, 1)."""

    def __init__(self, input_dim: int, heads: int, group: int, dim: int = DIM, sinks: int = SINKS):
        super().__init__()
        self.heads, self.group, self.dim, self.sinks = heads, group, dim, sinks
        self.q_proj = nn.Linear(input_dim, heads * group * dim, bias=True)
        self.k_proj = nn.Linear(input_dim, heads * dim, bias=False)
        self.q_norm = ScaledRMSNorm(dim)
        self.k_norm = ScaledRMSNorm(dim)
        self.k_base = nn.Parameter(torch.zeros(heads, 1, sinks, dim))
        self.b = nn.Parameter(torch.zeros(heads, 1, group))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        queries = self.q_norm(self.q_proj(hidden).view(n, self.heads, self.group, self.dim))
        keys = self.k_norm(self.k_proj(hidden).view(n, self.heads, 1, self.dim))
        queries = queries.transpose(0, 1).transpose(-1, -2)  # [H, n, dim, group]
        keys = keys.transpose(0, 1)  # [H, n, 1, dim]
        scale = math.sqrt(self.dim)
        own = torch.matmul(keys, queries) / scale + self.b.unsqueeze(2)  # [H, n, 1, group]
        learned = torch.matmul(self.k_base, queries) / scale  # [H, n, sinks, group]
        score = 1 / (1 + torch.exp(learned - own).sum(2, keepdim=True))
        return score.mean(-1).squeeze(-1)  # [H, n]


def initial(input_dim: int, heads: int, group: int, seed: int) -> Gate:
    """The untrained gate of a fit seeded with `seed` (torch's default initialisation, the learned sinks and biases 0)."""
    torch.manual_seed(seed)
    return Gate(input_dim, heads, group)


def rate_share(step: int, steps: int) -> float:
    """The share of the learning rate at `step` of `steps`: a linear warm-up over the first 1%, then 1, 1/2 from
    half the steps, 1/4 from three quarters."""
    warm = steps // 100
    if step < warm:
        return (step + 1) / warm
    return 1.0 if step < steps / 2 else (0.5 if step < 3 * steps / 4 else 0.25)


def loss(predicted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of scores [H, b] against KVzip's [H, b]: mean over entries, summed over heads."""
    return nn.functional.binary_cross_entropy(predicted, targets, reduction="none").mean(-1).sum()


def fit_gate(inputs: torch.Tensor, targets: torch.Tensor, group: int, steps: int = STEPS, lr: float = LR,
             batch: int = BATCH, seed: int = 0) -> Gate:
    """One layer's gate fitted on (attention inputs [N, D], KVzip scores [N, H]), deterministic under `seed`."""
    x, y = inputs.float(), targets.float().clamp(0, 1)
    gate = initial(x.shape[1], y.shape[1], group, seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(gate.parameters(), lr=lr, momentum=MOMENTUM)
    per_pass = math.ceil(len(x) / batch)
    for step in range(steps):
        if step % per_pass == 0:
            order = torch.randperm(len(x), generator=generator)
        pick = order[(step % per_pass) * batch:(step % per_pass + 1) * batch]
        for group_ in optimizer.param_groups:
            group_["lr"] = lr * rate_share(step, steps)
        optimizer.zero_grad()
        loss(gate(x[pick]), y[pick].T).backward()
        optimizer.step()
    return gate.eval()


def predict(gate: Gate, hidden: torch.Tensor) -> torch.Tensor:
    """Scores [H, n] (float32) of the entries whose attention inputs are `hidden` [n, D]."""
    with torch.inference_mode():  # the prefill's hidden states are inference tensors
        return gate.to(hidden.device)(hidden.float())


def save(path: str | Path, gates: list[Gate], provenance: dict) -> Path:
    """The gates (float16, the press's parameter names) and `path`.json with their shapes and `provenance`."""
    tensors = {f"layers.{i}.{name}": value.to(torch.float16) for i, gate in enumerate(gates)
               for name, value in gate.state_dict().items()}
    first = gates[0]
    shape = {"gate": "fastkvzip", "input_dim": first.q_proj.in_features, "heads": first.heads, "group": first.group,
             "dim": first.dim, "sinks": first.sinks, "n_modules": len(gates)}
    return fitted_weights.save(path, tensors, {**shape, **provenance})


def load(path: str | Path) -> tuple[list[Gate], dict]:
    """(gates in float32, their provenance) from a weights file; every problem is one line naming the file."""

    def build(info: dict, tensors: dict) -> list[Gate]:
        gates = []
        for i in range(int(info["n_modules"])):
            gate = Gate(int(info["input_dim"]), int(info["heads"]), int(info["group"]), int(info["dim"]),
                        int(info["sinks"]))
            prefix = f"layers.{i}."
            gate.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            gates.append(gate.eval())
        return gates

    return fitted_weights.load(path, "FastKVzip gates", FIT, build)
