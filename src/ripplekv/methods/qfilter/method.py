"""Q-Filters: a key's score is minus its dot product with its (layer, KV head)'s filter, fitted on calibration queries.

Our reading of Godey et al. (arXiv 2503.02812) and kvpress's `QFilterPress` (read, not copied). Queries share one
favoured direction u per head, so a key's mean attention logit over future queries is about kappa <k, u>
(kappa > 0): the keys with the largest projection on u are kept. The filters (`methods.qfilter.filters`) hold -u,
the published sign, and the score is -<k, filter> exactly as kvpress computes it (on the stored, post-RoPE keys,
in float32). The top entries per head are kept at the budget, like any scorer, so budgets are exact; the last
`window` (32) tokens are always kept, as our other window scorers keep them (the authors' cache protects a window
too); kvpress's press keeps none (`qfilter:window=0` is that press, for make check-references).

The filters are fitted here on calibration prompts (`ripplekv fit qfilter`, `pipeline.qfilter_fit`), never on
evaluated ones: the published ones are for a few larger models on a hub we cannot reach. For the bundled model
they ship in `data/qfilter/`; another model takes `qfilter:weights=FILE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ripplekv
from ripplekv.methods.core import fitted_weights
from ripplekv.methods.core.base import FILE, check_integers, register_scorer
from ripplekv.methods.qfilter import filters as qfilters
from ripplekv.methods.snapkv import WindowScorer

NAMES = ("layers", "KV heads", "head size")  # what a filter file is fitted for

SHIPPED = Path(ripplekv.__file__).resolve().parent / "data" / "qfilter"  # the package's data, wherever this module sits


def shipped_filters() -> Path:
    """The bundled model's fitted filters (they may be missing in a checkout that never fitted them)."""
    from ripplekv.engine.models import DEFAULT_MODEL

    return SHIPPED / f"{DEFAULT_MODEL}-qfilter.safetensors"


def loaded(path: Path):
    """(filters [L, H_kv, d], provenance) of a weights file, loaded once per file version."""
    return fitted_weights.loaded_once(path, qfilters.load)


@register_scorer("qfilter")
@dataclass(frozen=True)
class QFilterScorer(WindowScorer):
    weights: str | None = field(default=None, metadata=FILE)

    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)
        if self.weights is not None:
            loaded(Path(self.weights))  # a missing or bad file is one line before any model work

    def floor(self) -> int:
        return max(self.window, 1)

    def weights_for(self, state, bundled: bool | None = None) -> Path:
        """The filters given, or the shipped ones for the bundled model."""
        return fitted_weights.given_or_shipped(self.weights, shipped_filters(), state, bundled,
                                               f"qfilter needs Q-filters fitted for this model; {qfilters.FIT_HINT}")

    def check_fitted(self, shape, bundled: bool, scorer=None) -> None:
        """Before any prefill: filters exist for the model (`shape`: layers, KV heads, hidden size); at a budget
        no smaller than the prompt they are never read, so only this check would say."""
        path = self.weights_for(None, bundled)
        fitted_weights.check_shape("Q-filters", path, loaded(path)[0].shape[:2], shape[:2], qfilters.FIT_HINT, NAMES)

    def scores(self, state, layer):
        path = self.weights_for(state)
        filters = loaded(path)[0]
        expected = (state.num_layers, state.num_kv_heads, state.keys[layer].shape[-1])
        fitted_weights.check_shape("Q-filters", path, filters.shape, expected, qfilters.FIT_HINT, NAMES)
        window = min(self.window, state.length)
        keys = state.keys[layer][:, : state.length - window].float()
        return -(filters[layer].to(keys.device)[:, None, :] * keys).sum(-1)
