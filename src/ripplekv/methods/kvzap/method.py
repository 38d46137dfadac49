"""KVzap: KVzip's scores predicted from each layer's hidden states by a small surrogate, with no second pass.

Our reading of Jegou et al. (arXiv 2601.07891) and kvpress's `KVzapPress` (read, not copied). Each layer's
surrogate (`methods.kvzap.surrogate`: linear, or kvpress's 2-layer MLP) maps an entry's attention input (the
hidden state after the layer's input norm, recorded by the prefill: the `hidden_states` signal) to a
predicted log KVzip score per KV head; the top entries per head are kept at the budget, like any scorer, so
budgets are exact (`kvzap` keeps what SnapKV keeps in number). The last `window` (32) tokens are always kept,
as our other window scorers keep them: the paper protects a sliding window of 128 in its threshold mode;
kvpress's `KVzapPress` on its own keeps none (`kvzap:window=0` is that press, for make check-references).

The surrogate is fitted here on calibration prompts (`ripplekv fit kvzap`, `pipeline.kvzap_fit`), never on
evaluated ones: the published ones are trained for 8B models on a hub we cannot reach. For the bundled model
they ship in `data/kvzap/`; another model takes `kvzap:weights=FILE`. Its targets are our KVzip scorer's
(max attention in the reconstruction pass), not the paper's KVzip+ (which also weighs by ||W_O v|| / ||h||).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ripplekv
from ripplekv.engine import adapter
from ripplekv.engine.prefill import Requirements
from ripplekv.engine.recorders import PerLayer, register_recorder
from ripplekv.errors import UserError
from ripplekv.methods.core import fitted_weights
from ripplekv.methods.core.base import FILE, check_integers, register_scorer
from ripplekv.methods.kvzap import surrogate as kvzap_surrogate
from ripplekv.methods.snapkv import WindowScorer

SHIPPED = Path(ripplekv.__file__).resolve().parent / "data" / "kvzap"  # the package's data, wherever this module sits
FIT_HINT = ("fit one on calibration prompts: ripplekv fit kvzap --model M --out DIR, then pass "
            "kvzap:weights=DIR/kvzap-MODEL.safetensors")


def shipped_weights(kind: str) -> Path:
    """The bundled model's fitted surrogate of `kind` (it may be missing in a checkout that never fitted one)."""
    from ripplekv.engine.models import DEFAULT_MODEL

    return SHIPPED / f"{DEFAULT_MODEL}-{kind}.safetensors"


def surrogate(path: Path):
    """(layers, provenance) of a weights file, loaded once per file version."""
    return fitted_weights.loaded_once(path, kvzap_surrogate.load)


HIDDEN_STATES = "hidden_states"  # the signal: each layer's attention input [n, D] after its norm


@register_recorder(HIDDEN_STATES)
class HiddenStates(PerLayer):
    """Each layer's attention input [n, D] (the hidden state after the layer's input norm, the `hidden_states` a
    kvpress press reads), kept in the model's dtype: KVzap's surrogate scores entries from it. Attention
    never sees it, so a forward pre-hook on each attention module reads it."""

    def attach(self, model) -> list:
        def keep(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.layers[module.layer_idx] = hidden[0].detach().clone()

        return [layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True)
                for layer in adapter.decoder_layers(model)]


@register_scorer("kvzap")
@dataclass(frozen=True)
class KVzapScorer(WindowScorer):
    model: str = "mlp"
    weights: str | None = field(default=None, metadata=FILE)

    def __post_init__(self):
        check_integers({"window": self.window}, minimum=0)
        if self.model not in kvzap_surrogate.KINDS:
            raise UserError(f"option model must be one of {', '.join(kvzap_surrogate.KINDS)}, got {self.model!r}")
        if self.weights is not None:
            info = surrogate(Path(self.weights))[1]  # a bad file is one line before any model work
            if info["surrogate"] != self.model:
                raise UserError(f"KVzap weights {self.weights} hold a {info['surrogate']} surrogate; this method asks "
                                f"for model={self.model} (set model={info['surrogate']} or fit a {self.model} one)")

    def floor(self) -> int:
        return max(self.window, 1)

    def requirements(self) -> Requirements:
        return Requirements(signals={HIDDEN_STATES})

    def weights_for(self, state, bundled: bool | None = None) -> Path:
        """The weights given, or the shipped ones for the bundled model."""
        return fitted_weights.given_or_shipped(self.weights, shipped_weights(self.model), state, bundled,
                                               f"kvzap needs a fitted {self.model} surrogate for this model; {FIT_HINT}")

    def check_fitted(self, shape, bundled: bool, scorer=None) -> None:
        """Before any prefill: the surrogate exists and fits the model (`shape`: layers, KV heads, hidden size);
        at a budget no smaller than the prompt it is never called, so only this check would say."""
        path = self.weights_for(None, bundled)
        layers, info = surrogate(path)
        fitted_weights.check_shape("KVzap weights", path, (len(layers), info["output_dim"], info["input_dim"]), shape,
                                   FIT_HINT)

    def log_scores(self, state, layer: int):
        """Predicted log KVzip scores [H_kv, n] of every prompt entry of `layer` (computed once per prefill)."""
        path = self.weights_for(state)
        return state.memo((predicted_scores, str(path), layer), lambda: predicted_scores(state, path, layer))

    def scores(self, state, layer):
        window = min(self.window, state.length)
        return self.log_scores(state, layer)[:, : state.length - window]


def predicted_scores(state, path: Path, layer: int):
    """The surrogate at `path` applied to `layer`'s recorded hidden states: log KVzip scores [H_kv, n]."""
    layers, info = surrogate(path)
    hidden = state.signal(HIDDEN_STATES)
    fitted_weights.check_shape("KVzap weights", path, (len(layers), info["output_dim"], info["input_dim"]),
                               (state.num_layers, state.num_kv_heads, hidden[layer].shape[-1]), FIT_HINT)
    return kvzap_surrogate.predict(layers[layer], hidden[layer])
