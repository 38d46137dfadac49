"""CompressKV: static layer budgets from an offline per-layer error profile.

Our reading of arXiv 2508.02401 and of TUDa-HWAI/CompressKV (`pred_get_importance_score.py`,
`modeling_llama_new.py`, `pred_compresskv.py`, read, not copied): offline, each layer's error is the
relative Frobenius error of its attention output (after W_o) when its KV cache is restricted to a small
selection, summed over decoding steps and averaged over prompts; online, every layer keeps 32 entries plus
a share of the rest proportional to its normalized error, capped at 3 x B (`error_aware_layer_budget_allocation`).

Where ours differs:
- The reference profiles LongBench's own test prompts; ours must come from calibration prompts disjoint
  from the evaluation (`ripplekv fit compresskv` runs `calibrate` on the offline suite's calibration
  split and writes the `layer,error` CSV; pass it as `compresskv:profile=FILE`; `COMPRESSKV_CALIB_SAMPLES`
  in a reproduce config does both).
  The error is measured at the calibration prompts' observation-window queries (the last `window` prompt
  tokens standing in for the decoding steps), with SnapKV's selection at a uniform budget as the small
  selection.
- The floor is the scorer's window (not 32) and integer budgets make the total exactly L x H_kv x B (the
  reference nudges its rounded budgets by one until they sum).
- Tokens are ranked by SnapKV's scores: the reference's scorer (the attention of each layer's top
  "semantic retrieval heads", found offline with needle-in-a-haystack runs) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ripplekv.engine import adapter
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods.core.base import FILE, Allocator, register_allocator
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.core.tables import check_layer_count, read_numbers
from ripplekv.methods.snapkv import SnapKVScorer, window_attention

CAP = 3  # a layer keeps at most CAP x B entries (the reference's max_tokens)


def layer_errors(state, budget: int, window: int = 32) -> list[float]:
    """Per layer: ||o_sel - o_full||_F / ||o_full||_F of the window queries' attention output after W_o, where
    o_sel attends only to the entries SnapKV keeps at a uniform `budget` (the window's own attention renormalized)."""
    window = min(window, state.length)
    scorer = SnapKVScorer(window=window)
    errors = []
    for layer in range(state.num_layers):
        attention = window_attention(state, layer, window, who="CompressKV")  # [H_kv, group, w, n]
        counts = torch.full((state.num_kv_heads,), min(budget, state.length), device=state.device)
        kept = scorer.keep(state, layer, counts).float()[:, None, None, :]
        restricted = attention * kept
        restricted = restricted / restricted.sum(-1, keepdim=True).clamp_min(1e-30)
        values = state.values[layer].float()[:, None]  # [H_kv, 1, n, d]
        project = adapter.output_projection(state.model, layer).to(values.device)  # [H_q, d, hidden]
        full = attention_output(attention, values, project)
        error = torch.linalg.norm(attention_output(restricted, values, project) - full) / (torch.linalg.norm(full) + 1e-5)
        errors.append(float(error))
    return errors


def attention_output(weights: torch.Tensor, values: torch.Tensor, project: torch.Tensor) -> torch.Tensor:
    """[w, hidden]: attention `weights` [H_kv, group, w, n] over `values` [H_kv, 1, n, d], through W_o [H_q, d, hidden]."""
    heads = torch.matmul(weights, values).reshape(-1, weights.shape[2], values.shape[-1])  # [H_q, w, d]
    return torch.einsum("hwd,hde->we", heads, project)


def calibrate(model, prompts, budget: int, window: int = 32) -> list[float]:
    """The per-layer error averaged over calibration prompts (token id lists), each prefilled once."""
    check_budget(budget)
    if not prompts:
        raise UserError("CompressKV's profile needs at least one calibration prompt")
    totals = None
    for ids in prompts:
        state = prefill_for(model, ids, Requirements(capture_window=window))
        errors = layer_errors(state, budget, window)
        totals = errors if totals is None else [a + b for a, b in zip(totals, errors)]
    return [total / len(prompts) for total in totals]


def write_profile(path: str | Path, errors) -> Path:
    """The `layer,error` CSV that `compresskv:profile=` reads."""
    from ripplekv.errors import write_failure

    path = Path(path)
    try:  # a missing folder is made, as the commands make theirs; a failure is one line naming the file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("layer,error\n" + "".join(f"{layer},{error!r}\n" for layer, error in enumerate(errors)))
    except OSError as err:
        raise write_failure(path, err, "run the script again") from None
    return path


@register_allocator("compresskv")
@dataclass(frozen=True)
class CompressKV(Allocator):
    """Budgets: the floor plus a share of the rest proportional to each layer's profiled error, capped at 3 x B."""

    profile: str | None = field(default=None, metadata=FILE)
    errors: tuple[float, ...] | None = None

    def __post_init__(self):
        self.check_heads()
        if self.errors is None:
            if self.profile is None:
                raise UserError("compresskv needs a layer error profile from calibration prompts: run "
                                "`ripplekv fit compresskv --out FILE`, then pass compresskv:profile=FILE")
            errors = read_numbers(self.profile, "error", "compresskv profile", "write it with compresskv.write_profile")
            object.__setattr__(self, "errors", tuple(errors))
        if any(e < 0 for e in self.errors) or not any(e > 0 for e in self.errors):
            raise UserError("compresskv's layer errors must be >= 0 with at least one > 0")

    def layer_budgets(self, num_layers, budget, length, floor):
        check_budget(budget)
        check_layer_count(len(self.errors), num_layers, "compresskv profile", "profile and evaluate with the same model")
        spare = num_layers * max(budget - min(floor, budget), 0)
        total = sum(self.errors)
        targets = [min(floor, budget) + spare * e / total for e in self.errors]
        if length <= budget:
            return [length] * num_layers
        return integer_budgets(targets, budget, min(length, CAP * budget), floor)
