"""Q-Filters' filters: one direction per (layer, KV head), from the SVD of the layer's queries; saved and loaded.

Our reading of Godey et al. (arXiv 2503.02812) and its authors' `make_filters.py` (NathanGodey/qfilters), read,
not copied. For each query head, Q is the matrix of its queries over the calibration prompts, *after RoPE* (what
attention multiplies with the cached keys: the authors take them from their cache's `update`, which receives
the rotated states). Its first right singular vector v, signed so that the queries' mean projection on it is
positive (the paper's E<Q, u> > 0; the authors' script signs it by the majority of projections instead, the same
sign wherever the direction is pronounced), is the direction u whose projection estimates a key's mean attention
logit. With GQA, a KV head's direction is the mean of its query heads' signed directions (the authors' script
averages the per-query-head filters; it does not pool the group's queries into one SVD).

The file stores -u, the sign of the published filters and of kvpress's `QFilterPress`, whose score is minus a key's
dot product with the filter: the keys kept are those with the largest projection on u.

The first right singular vector of Q is the top eigenvector of the Gram matrix Q^T Q, so each prompt only adds
its queries' Q^T Q and sum to the statistics (`QUERY_SUMS`, recorded in the prefill): a fit is exact over every
position of every calibration prompt (the authors' script samples 3,000 positions) and resumes prompt by prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ripplekv.engine.recorders import PerLayer, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.core import fitted_weights

QUERY_SUMS = "qfilter_query_sums"  # the signal: per layer a `QueryGram` of every prompt query, post-RoPE
TENSOR = "q_filters"  # the weights file's one tensor [L, H_kv, d] (kvpress's `QFilters.q_filters`)
FIT_HINT = "fit them on calibration prompts: ripplekv fit qfilter --model M --out DIR, then pass qfilter:weights=DIR/qfilter.safetensors"


@dataclass
class QueryGram:
    """Sums over one layer's prompt queries after RoPE, per query head, in float64: never the queries."""

    count: int
    total: torch.Tensor  # [H_q, d]: sum of q
    gram: torch.Tensor  # [H_q, d, d]: sum of q q^T (= Q^T Q)


@register_recorder(QUERY_SUMS)
class QueryGrams(PerLayer):
    """Each layer's `QueryGram` (the fit of `ripplekv fit qfilter` reads it; no scorer does)."""

    def layer(self, index, query, key, value, attention_mask, scaling):
        queries = query[0].double()
        self.layers[index] = QueryGram(int(queries.shape[1]), queries.sum(1).cpu(),
                                       torch.einsum("hni,hnj->hij", queries, queries).cpu())


def signed_directions(gram: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u [..., d], share [...]): per query head the first right singular vector of its queries (the top eigenvector
    of their Gram matrix `gram` [..., d, d]) signed so their mean projection on it (`total` [..., d], their sum) is
    positive, and the share of the queries' squared norm along it (sigma_1^2 / sum sigma^2)."""
    values, vectors = np.linalg.eigh(np.asarray(gram, dtype=np.float64))  # ascending eigenvalues
    top = vectors[..., :, -1]
    sign = np.where((top * np.asarray(total, dtype=np.float64)).sum(-1) < 0, -1.0, 1.0)
    share = values[..., -1] / np.maximum(values.sum(-1), np.finfo(np.float64).tiny)
    return top * sign[..., None], share


def filters_from(gram: np.ndarray, total: np.ndarray, kv_heads: int) -> tuple[np.ndarray, dict]:
    """The filters [L, H_kv, d] (float32, the published sign) from per layer and query head sums `gram` [L, H_q, d, d]
    and `total` [L, H_q, d], with what the provenance reports of them."""
    directions, share = signed_directions(gram, total)
    layers, query_heads, dim = directions.shape
    if query_heads % kv_heads:
        raise UserError(f"{query_heads} query heads do not split into {kv_heads} KV heads")
    grouped = directions.reshape(layers, kv_heads, query_heads // kv_heads, dim).mean(2)
    agreement = np.linalg.norm(grouped, axis=-1)  # 1: the group's query heads share one direction
    return (-grouped).astype(np.float32), {
        "first_direction_share_per_layer": [round(float(v), 4) for v in share.mean(1)],
        "group_agreement_per_layer": [round(float(v), 4) for v in agreement.mean(1)]}


def save(path: str | Path, filters: np.ndarray, provenance: dict) -> Path:
    """The filters (float32, kvpress's tensor name) and `path`.json with their shape and `provenance`, each file
    replaced whole (a kill leaves the old one or the new one)."""
    tensor = torch.as_tensor(np.ascontiguousarray(filters, dtype=np.float32))
    layers, kv_heads, dim = tensor.shape
    return fitted_weights.save(path, {TENSOR: tensor}, {"layers": layers, "kv_heads": kv_heads, "head_dim": dim,
                                                        **provenance})


def load(path: str | Path) -> tuple[torch.Tensor, dict]:
    """(filters [L, H_kv, d] float32, provenance) of a weights file; every problem is one line naming the file."""

    def build(info: dict, tensors: dict) -> torch.Tensor:
        filters = tensors[TENSOR]
        if filters.dim() != 3:
            raise ValueError(f"{TENSOR} has {filters.dim()} dimensions, not 3 (layers, KV heads, head size)")
        return filters

    return fitted_weights.load(path, "Q-filters", "ripplekv fit qfilter", build, hint=FIT_HINT)
