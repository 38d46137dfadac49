"""LU-KV's per-prompt statistics: the oracle importance of every prompt entry and the scorer's ranking of it.

Our reading of arXiv 2602.08585 and of its `step1_*.py` (through their public descriptions; docs/methods.md
lists what we chose where they are silent). The oracle importance of entry j in KV head (l, h) is the most
any query of the full cache's own answer puts through it: max over the answer's decode steps k and over
the query heads g of the KV head's group of A[l, g, k, j] x ||v_j W_O^(l, g)||_2, the value norm after
head g's slice of the output projection, divided by its sum over the layer's query heads and prompt
entries (the reference's per-layer normalisation, which makes layers comparable in one greedy). The
answer is the full cache's greedy answer (the reference samples one at temperature 0.7: a selection must be
a function of the prompt here), at most `ANSWER_TOKENS` (64, as the reference) tokens, each read after the
whole prompt through the full cache; its queries attend over the prompt and the answer before them. The
prompt is the whole calibration prompt, question included, as our with-question protocol compresses it
(the reference prefills the context alone and asks the question after it).
"""

from __future__ import annotations

import numpy as np
import torch

from ripplekv.engine import adapter
from ripplekv.engine.decode import greedy_decode, stop_tokens
from ripplekv.engine.prefill import PrefillState, Requirements, prefill_for
from ripplekv.engine.recorders import SampleContext
from ripplekv.errors import UserError
from ripplekv.methods.lukv.greedy import prune_ratios
from ripplekv.methods.lukv.method import protected
from ripplekv.methods.signals.continuation import causal_attention_rows, probe_tokens

ANSWER_TOKENS = 64


def output_norms(state: PrefillState, layer: int) -> torch.Tensor:
    """||v_j W_O^(g)||_2 [H_kv, group, n] for every query head g, divided by their sum over the layer."""
    weight = adapter.output_projection(state.model, layer).to(state.device)  # [H_q, d, hidden]
    values = state.values[layer].float()  # [H_kv, n, d]
    kv_heads, length, dim = values.shape
    weight = weight.view(kv_heads, weight.shape[0] // kv_heads, dim, -1)
    norms = torch.cat([torch.matmul(values[:, None, start:start + 128], weight).norm(dim=-1)
                       for start in range(0, length, 128)], dim=-1)  # [H_kv, group, n]
    return norms / norms.sum().clamp_min(1e-30)


@torch.inference_mode()
def oracle_importance(state: PrefillState, answer: list[int]) -> torch.Tensor:
    """[L, H_kv, n] float32: the most weighted attention any answer query pays each prompt entry."""
    importance = torch.zeros(state.num_layers, state.num_kv_heads, state.length, device=state.device)
    weights = {}

    def reduce(layer, queries, new_keys):
        if layer not in weights:
            weights[layer] = output_norms(state, layer)[:, :, None, :]
        for _, block in causal_attention_rows(queries, state.keys[layer], new_keys, state.scaling):
            importance[layer] = torch.maximum(importance[layer], (block * weights[layer]).amax(dim=(1, 2)))

    probe_tokens(state.model, state, answer, reduce)
    return importance


def ranking(scorer, state: PrefillState) -> torch.Tensor:
    """The scorer's scores of every entry [L, H_kv, n] (its always-kept window last, at +inf)."""
    if not hasattr(scorer, "window"):
        raise UserError(f"a LU-KV curve needs a scorer that ranks each head's entries (snapkv, lukv, keydiff, ...), "
                        f"not {scorer.name}")
    rows = []
    for layer in range(state.num_layers):
        scores = scorer.scores(state, layer).float()
        pad = scores.new_full((scores.shape[0], state.length - scores.shape[1]), float("inf"))
        rows.append(torch.cat([scores, pad], dim=1))
    return torch.stack(rows)


def prompt_curves(model, tokenizer, ids: list[int], scorers: dict, layerwise: bool = True,
                  answer_tokens: int = ANSWER_TOKENS) -> tuple[dict[str, np.ndarray], int]:
    """One calibration prompt's per-head prune ratios [99, L, H_kv] for each scorer (by name), from one prefill, one
    greedy answer and one pass of it; and the answer's length."""
    needs = Requirements.of_all(scorers.values())
    state = prefill_for(model, torch.as_tensor(ids), needs, context=SampleContext(tokenizer=tokenizer))
    answer = list(greedy_decode(model, state, None, answer_tokens, stop_tokens(model, tokenizer), num_variants=1)[0])
    importance = oracle_importance(state, answer).cpu().numpy().astype(np.float64)
    curves = {}
    for name, scorer in scorers.items():
        sink, window = protected(scorer)
        scores = ranking(scorer, state).cpu().numpy().astype(np.float64)
        curves[name] = prune_ratios(importance, scores, sink, window, layerwise)
    return curves, len(answer)
