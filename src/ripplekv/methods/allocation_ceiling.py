"""`answer-allocation` (earlier `allocation-ceiling`): layer and head budgets chosen knowing the answer, SnapKV
choosing the entries.

Answer-aware, not a method, and not a bound: attention the answer pays is not what the answer's KL needs, so
learned allocators beat it (on the bundled model, uniform does too at B >= 256). Every head
keeps its scorer's window; the rest of the L x H_kv x B entries go to the (layer, head, prefix entry)
triples the full cache's answer attends to most (the oracle's answer-aware scores, `methods.oracle`,
competing over all layers and heads at once), and a head's count is its window plus the triples it won.
The counts sum to exactly L x H_kv x B with no rounding. Which entries a head then keeps is the scorer's
choice (SnapKV's in the `answer-allocation` preset): what an allocation read off the answer's attention
gets with that scorer. It needs the answer, so only `ripplekv eval` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.core.base import Allocator, register_allocator
from ripplekv.methods.core.budgets import check_budget
from ripplekv.methods.oracle import OracleScorer, answer_attention


@register_allocator("answer")
@dataclass(frozen=True)
class AnswerBudgets(Allocator):
    knows_answer = True
    prompt_dependent = True
    prompt_note = "`ripplekv eval` records its per-layer and per-head counts per sample"

    def requirements(self):
        return OracleScorer().requirements()  # what the answer-aware scores need, declared as the oracle declares it

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"the answer-aware allocation's budgets depend on each sample's answer; {self.prompt_note}")

    def allocate(self, state, budget, scorer):
        check_budget(budget)
        layers, heads, length = state.num_layers, state.num_kv_heads, state.length
        if length <= budget:
            return np.full((layers, heads), length, dtype=np.int64)
        floor = min(scorer.floor(), budget)
        counts = np.full((layers, heads), floor, dtype=np.int64)
        spare = layers * heads * (budget - floor)
        if spare == 0:
            return counts
        scores = answer_attention(state)[:, :, : length - floor].float()  # the prefix beyond each head's window
        won = torch.topk(scores.reshape(-1), spare).indices // scores.shape[-1]
        counts += np.bincount(won.cpu().numpy(), minlength=layers * heads).reshape(layers, heads)
        return counts
