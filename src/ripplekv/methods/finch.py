"""Finch: the question's own tokens are the observation window, and what they attend to is kept.

Our reading of Corallo and Papotti (TACL 2024), "FINCH: Prompt-guided Key-Value Cache Compression for Large
Language Models", and of kvpress's FinchPress (read, not copied). The prompt is a context followed by a question;
every query of the question part scores the entries before it (softmax over everything it sees), each row
multiplied by the number of keys before its own position (`normalize=1`, kvpress's `normalize_scores`: a later
query's attention is spread over more keys), then averaged over the question's queries and over the query heads
sharing a KV head. No pooling. The question part is always kept and the rest of a head's count goes to the top
scores, so the window is as long as the question, not a fixed width.

Where the question starts: kvpress asks the user to put a delimiter token between context and question, finds it
during the prefill and drops it from the embeddings. Here the boundary is the task's own prompt split (where the
template's text after `{context}` begins, the cut the context-only protocol makes; `SampleContext.question_at`),
so the prompt the model reads is unchanged and no token is added to the vocabulary. A prompt with no such part
(a task whose template ends with its context, a text file, token ids without a task, or `--protocol
context-only`, where the question is read after compression) is refused in one line.

Where ours differs from FinchPress:
- kvpress re-rotates the kept keys to contiguous positions (`rerotate_keys=True`). Ours keeps every key at the
  position it was prefilled at, as every method here does (new tokens continue from the prompt's length), so the
  kept *sets* are comparable (make check-references holds them against FinchPress's own) and the decoding is the
  same protocol as for the other methods; re-rotation as an option of any method is a separate axis.
- A head given fewer entries than the question keeps the question's last ones (kvpress's top-k would choose
  among the question's tied scores).
- kvpress's `chunk_length` (top-k within chunks of the prompt, each keeping `int(c x (1 - ratio))`) is not
  offered: its per-chunk rounding does not keep an exact budget; its default (None) is what we run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import PerLayer, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.core.base import Scorer, register_scorer
from ripplekv.methods.core.selection import window_or_top

QUESTION_QUERIES = "question_queries"  # per layer [H_q, w, d]: the queries of the prompt's question part
ROWS = 128  # question queries per block of scores: [H_q, ROWS, n] logits at a time


@register_recorder(QUESTION_QUERIES)
class QuestionQueries(PerLayer):
    """The post-RoPE queries from where the sample's question part begins (`SampleContext.question_at`) to the end
    of the prompt; nothing when the sample brings no such boundary."""

    def layer(self, index, query, key, value, attention_mask, scaling):
        start = self.setup.sample.question_at
        if start is not None and 0 < start < query.shape[2]:
            self.layers[index] = query[0, :, start:].detach().clone()

    def result(self, num_layers):
        return super().result(num_layers) if len(self.layers) == num_layers else None


def question_queries(state, layer: int) -> torch.Tensor:
    """[H_q, w, d] of `layer`; one line when the prompt had no question part to record."""
    recorded = state.signal(QUESTION_QUERIES, None)
    if recorded is None:
        raise UserError("finch needs the question inside the compressed prompt (the task's context/question split); "
                        "this prompt has none: use a task whose prompt has a question after its context, under "
                        "--protocol with-question")
    return recorded[layer]


def question_length(state) -> int:
    return int(question_queries(state, 0).shape[1])


def finch_scores(state, layer: int, normalize: bool) -> torch.Tensor:
    """[H_kv, n - w] float32: the question queries' attention to each earlier entry, each query's row times the
    number of positions before it when `normalize`, averaged over the question and a KV head's query heads."""
    queries = question_queries(state, layer).float()  # [H_q, w, d]
    keys = state.keys[layer].float()  # [H_kv, n, d]
    kv_heads, length = keys.shape[0], keys.shape[1]
    group, width = queries.shape[0] // kv_heads, queries.shape[1]
    prefix = length - width
    grouped = queries.view(kv_heads, group, width, -1) * state.scaling
    positions = torch.arange(length, device=keys.device)
    sliding = state.window(layer) if hasattr(state, "window") else None
    total = torch.zeros(kv_heads, prefix, dtype=torch.float32, device=keys.device)
    for start in range(0, width, ROWS):
        stop = min(width, start + ROWS)
        logits = torch.matmul(grouped[:, :, start:stop], keys[:, None].transpose(-1, -2))  # [H_kv, group, r, n]
        at = prefix + torch.arange(start, stop, device=keys.device)[:, None]
        visible = positions[None, :] <= at
        if sliding is not None:
            visible &= positions[None, :] > at - sliding
        weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)[..., :prefix]
        if normalize:
            weights = weights * at.to(weights.dtype)  # query at position p sees p earlier positions
        total += weights.sum(dim=(1, 2))
    return total / (width * group)


@register_scorer("finch")
@dataclass(frozen=True)
class FinchScorer(Scorer):
    """Keep the question part and the entries its queries attend to most (see the module docstring)."""

    normalize: int = 1

    def __post_init__(self):
        if self.normalize not in (0, 1):
            raise UserError(f"option normalize must be 0 or 1, got {self.normalize!r}")

    def requirements(self) -> Requirements:
        return Requirements(signals={QUESTION_QUERIES})

    def scores(self, state, layer):
        """[H_kv, n]: the prefix's scores, then the question part at +inf (kept first wherever heads or layers
        compete: the window of a fixed width is left out of `scores` instead, but this one's width is the prompt's)."""
        prefix = state.memo((finch_scores, layer, bool(self.normalize)), lambda: finch_scores(state, layer, bool(self.normalize)))
        return torch.cat([prefix, prefix.new_full((prefix.shape[0], state.length - prefix.shape[1]), float("inf"))], dim=1)

    def keep(self, state, layer, counts):
        window = question_length(state)
        return window_or_top(state.num_kv_heads, state.length, counts, window,
                             lambda: self.scores(state, layer)[:, : state.length - window], device=state.device)
