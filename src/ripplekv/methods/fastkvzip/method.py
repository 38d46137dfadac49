"""FastKVzip: KVzip's scores predicted by a gate per layer from what the prefill already has, with no second pass.

Our reading of Kim, Han & Yun, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction" (arXiv
2601.17668) and of kvpress's `FastKVzipPress` (read, not copied). Each layer's gate (`methods.fastkvzip.gate`)
reads an entry's attention input (the hidden state after the layer's input norm, the `hidden_states` signal
KVzap's surrogate reads too) and scores it in (0, 1) per KV head; the first `n_sink` (4) entries score 1, as in
the press and in KVzip. Like `kvzip`, all layers and heads compete for one budget (the `global` allocator: the
press's default, non-layerwise), so `fastkvzip` and `kvzip` differ in the scorer alone, and budgets are exact.

The press also scores its local window 1: the last max(1, int(n x 0.02)) entries below 32,000 tokens, 4,096 from
there (the paper's chunked prefill keeps a window of 4,096). Ours keeps the last `window` (32) tokens, as our other
scorers do; `window_ratio=0.02:window=0` is the press's window, and
`fastkvzip:granularity=entry:window=0:window_ratio=0.02` given our gates is `FastKVzipPress` given them (make
check-references).

The gates are fitted here on calibration prompts (`ripplekv fit fastkvzip`, `pipeline.fastkvzip_fit`) on our
KVzip scorer's scores, never on evaluated prompts: the published ones are for a few 8B models on a hub we cannot
reach. For the bundled model they ship in `data/fastkvzip/`; another model takes `fastkvzip:weights=FILE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ripplekv
from ripplekv.engine.prefill import Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core import fitted_weights
from ripplekv.methods.core.base import FILE, check_integers, register_scorer
from ripplekv.methods.fastkvzip import gate as fastkvzip_gate
from ripplekv.methods.kvzap.method import HIDDEN_STATES
from ripplekv.methods.snapkv import WindowScorer

SHIPPED = Path(ripplekv.__file__).resolve().parent / "data" / "fastkvzip"  # the package's data, wherever this sits
LONG_PROMPT, LONG_WINDOW = 32000, 4096  # the press: from this many tokens its window is 4,096, not a ratio
HINT = f"fit them on calibration prompts: {fastkvzip_gate.FIT}"


def shipped_gates() -> Path:
    """The bundled model's fitted gates (missing in a checkout that never fitted them)."""
    from ripplekv.engine.models import DEFAULT_MODEL

    return SHIPPED / f"{DEFAULT_MODEL}.safetensors"


def gates(path: Path):
    """(gates, provenance) of a weights file, loaded once per file version."""
    return fitted_weights.loaded_once(path, fastkvzip_gate.load)


def ratio_window(length: int, ratio: float) -> int:
    """The press's local window on an `length`-token prompt (0 when `ratio` is 0: none)."""
    if ratio == 0:
        return 0
    return max(1, int(length * ratio)) if length < LONG_PROMPT else LONG_WINDOW


@register_scorer("fastkvzip")
@dataclass(frozen=True)
class FastKVzipScorer(WindowScorer):
    n_sink: int = 4
    window_ratio: float = 0.0
    weights: str | None = field(default=None, metadata=FILE)

    def __post_init__(self):
        check_integers({"window": self.window, "n_sink": self.n_sink}, minimum=0)
        if not 0 <= self.window_ratio < 1:
            raise UserError(f"option window_ratio must be at least 0 and below 1, got {self.window_ratio!r}")
        if self.weights is not None:
            gates(Path(self.weights))  # a bad file is one line before any model work

    def floor(self) -> int:
        return max(self.window, 1)

    def requirements(self) -> Requirements:
        return Requirements(signals={HIDDEN_STATES})

    def weights_for(self, state, bundled: bool | None = None) -> Path:
        """The gates given, or the shipped ones for the bundled model."""
        return fitted_weights.given_or_shipped(self.weights, shipped_gates(), state, bundled,
                                               f"fastkvzip has no fitted gates for this model; {HINT}")

    def check_fitted(self, shape, bundled: bool, scorer=None) -> None:
        """Before any prefill: the gates exist and fit the model (`shape`: layers, KV heads, hidden size)."""
        path = self.weights_for(None, bundled)
        layers, info = gates(path)
        fitted_weights.check_shape("FastKVzip gates", path, (len(layers), info["heads"], info["input_dim"]), shape, HINT)

    def gate_scores(self, state, layer: int):
        """The gate's scores [H_kv, n] of every prompt entry of `layer`, sinks and the press's window at 1."""
        path = self.weights_for(state)
        return state.memo((predicted_scores, str(path), layer, self.n_sink, self.window_ratio),
                          lambda: predicted_scores(state, path, layer, self.n_sink, self.window_ratio))

    def scores(self, state, layer):
        window = min(self.window, state.length)
        return self.gate_scores(state, layer)[:, : state.length - window]


def predicted_scores(state, path: Path, layer: int, n_sink: int, window_ratio: float):
    """The gates at `path` on `layer`'s recorded hidden states: scores [H_kv, n], the first `n_sink` and the
    press's window (`window_ratio`) set to 1."""
    layers, info = gates(path)
    hidden = state.signal(HIDDEN_STATES)
    fitted_weights.check_shape("FastKVzip gates", path, (len(layers), info["heads"], info["input_dim"]),
                               (state.num_layers, state.num_kv_heads, hidden[layer].shape[-1]), HINT)
    scores = fastkvzip_gate.predict(layers[layer], hidden[layer]).clone()
    scores[:, :n_sink] = 1.0
    window = ratio_window(state.length, window_ratio)
    if window:
        scores[:, -window:] = 1.0
    return scores
