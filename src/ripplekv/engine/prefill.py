"""Prefill once with full attention and keep what every compression method needs.

Compressing after a full-attention prefill is what SnapKV, PyramidKV and StreamingLLM do, so one prefill
serves every method and budget: per layer the full K/V (post-RoPE keys, as the model stores them) and the
observation-window queries; on request whatever else the methods declared (`Requirements`), each recorded
by its own recorder beside the model's attention (`engine.recorders`), so the prefill itself is the same
whichever methods run. Full attention maps are never materialized (tens of GB at 8k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from transformers import DynamicCache

from ripplekv.engine import adapter, entries
from ripplekv.engine import cache as kvcache
from ripplekv.engine.querystats import QueryStatistics
from ripplekv.engine.recorders import SampleContext, recorders_for
from ripplekv.errors import UserError

DEFAULT_CAPTURE_WINDOW = 64


@dataclass(frozen=True)
class Requirements:
    """What a method needs the one prefill to record. A run prefills once for the union of its methods'.

    Methods declare these (`Method.requirements()`); engine and pipeline code never ask for a method by name.
    """

    capture_window: int = 0  # the last w prompt tokens' queries (observation windows)
    accumulated_attention: bool = False  # every prompt query's attention summed per key (H2O)
    query_statistics: bool = False  # mean and second moment of every prompt query before RoPE (Expected Attention)
    tokenizer: bool = False  # the prompt's tokenizer, to phrase a request to the model (KVzip)
    reference_answer: bool = False  # the full cache's answer, once decoded (the answer-aware oracle)
    hidden_states: bool = False  # every layer's attention input [n, D] (after its norm), in the model's dtype (KVzap)

    def union(self, other: Requirements) -> Requirements:
        """Each field's larger value (True over False): what either needs."""
        return Requirements(**{f.name: max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    @staticmethod
    def of_all(items) -> Requirements:
        """The union of the requirements of `items` (anything with a `requirements()` method)."""
        total = Requirements()
        for item in items:
            total = total.union(item.requirements())
        return total


@dataclass
class PrefillState:
    """Everything a method needs from one prompt's prefill."""

    input_ids: torch.Tensor  # [n]
    keys: list[torch.Tensor]  # per layer [H_kv, n, d]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor]  # per layer [H_q, w, d], the last w prompt tokens' queries
    last_logits: torch.Tensor  # [vocab] next-token logits after the whole prompt
    scaling: float
    scores: dict = field(default_factory=dict)  # method scores shared across methods and budgets
    model: object = field(default=None, repr=False)  # for methods that need the model's RoPE (via adapter)
    # per layer [H_kv, n] float32: attention summed over all prompt queries, averaged over a KV head's
    # query heads (only when prefilled with accumulate=True)
    accumulated: list[torch.Tensor] | None = None
    # per layer, pre-RoPE query statistics (only when prefilled with query_statistics): see QueryStatistics
    query_stats: list[QueryStatistics] | None = None
    # further signals by their `Requirements` field, recorded only when a method declared them
    # (`engine.recorders`: "tokenizer", "reference_answer"); read them with `signal`
    signals: dict = field(default_factory=dict, repr=False)
    # per layer, the attention window of a sliding-window layer (None: the layer sees the whole prompt); None
    # when no layer slides. A sliding layer holds only its last `capacity(layer)` prompt entries.
    windows: list | None = None
    _full: dict = field(default_factory=dict, repr=False)

    def signal(self, name: str, why: str = ""):
        """The recorded signal `name` (a `Requirements` field); one clear line when this prefill has none."""
        if name not in self.signals:
            raise UserError(why or f"this prefill did not record {name!r}: declare Requirements({name}=True)")
        return self.signals[name]

    def full_entries(self, layer: int) -> entries.LayerEntries:
        """Every token `layer` holds as entries (a sliding layer: its window's): one shared object, so caches
        store it once."""
        if layer not in self._full:
            self._full[layer] = entries.full(self.keys[layer], self.values[layer], self.held_from(layer))
        return self._full[layer]

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: it sees the whole prompt)."""
        return None if self.windows is None else self.windows[layer]

    def capacity(self, layer: int) -> int:
        """How many prompt entries `layer` can hold: the prompt, or a sliding layer's last window - 1
        (`adapter.layer_capacities`)."""
        return self.capacities[layer]

    @property
    def capacities(self) -> list[int]:
        return adapter.layer_capacities(self.length, self.windows or [None] * self.num_layers)

    def held_from(self, layer: int) -> int:
        """The first prompt position `layer` holds (0 but on a sliding layer with a longer prompt)."""
        return self.length - self.capacity(layer)

    @property
    def hybrid(self) -> bool:
        """Whether some layer holds less than the prompt (a sliding window shorter than it)."""
        return any(cap < self.length for cap in self.capacities)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def num_query_heads(self) -> int:
        return int(self.window_queries[0].shape[0])


@torch.inference_mode()
def prefill(
    model, input_ids, capture_window: int = DEFAULT_CAPTURE_WINDOW, reserve: int = 0, accumulate: bool = False,
    requirements: Requirements | None = None, context: SampleContext | None = None,
) -> PrefillState:
    """Run the prompt once with full attention; keep K/V, window queries and the last logits.

    `reserve`: tokens that will follow the prompt (the answer), checked against the model's window.
    `accumulate`: also sum each key's attention over all prompt queries (`PrefillState.accumulated`).
    `requirements`: what the methods to be run need (`Requirements.of_all`); it widens the captured window
    and turns on each recorder asked for (`engine.recorders`). `context`: what the sample brings beside
    its tokens (tokenizer, question), kept only where `requirements` asks.
    Whatever is recorded, the model's own attention computes the prefill: K/V and logits do not change.
    """
    needs = requirements or Requirements()
    needs = needs.union(Requirements(capture_window=capture_window, accumulated_attention=accumulate))
    kvcache.install(model)
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(adapter.device(model))
    adapter.check_length(model.config, len(ids), reserve)
    recorders = recorders_for(needs, model, len(ids), needs.capture_window, context)
    # A plain cache keeps every prompt position in every layer (a model's own would cut sliding layers to their
    # window); the attention masks, sliding ones included, are the model's, so K/V and logits do not change.
    hooks = [hook for recorder in recorders for hook in recorder.attach(model)]
    try:
        out = model(input_ids=ids[None], cache=DynamicCache(), use_cache=True, logits_to_keep=1,
                    ripplekv_recorders=recorders)
    finally:
        for hook in hooks:
            hook.remove()
    dyn = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
    num_layers = model.config.num_hidden_layers
    keys = [dyn.layers[i].keys[0] for i in range(num_layers)]
    values = [dyn.layers[i].values[0] for i in range(num_layers)]
    recorded = {recorder.requirement: recorder.result(num_layers) for recorder in recorders}
    windows = adapter.layer_windows(model.config)
    return PrefillState(
        input_ids=ids,
        keys=keys,
        values=values,
        window_queries=recorded.pop("capture_window"),
        last_logits=out.logits[0, -1].float(),
        scaling=adapter.attention_scaling(model),
        model=model,
        accumulated=recorded.pop("accumulated_attention", None),
        query_stats=recorded.pop("query_statistics", None),
        signals=recorded,
        windows=windows if any(window is not None for window in windows) else None,
    )


def captured_window(needs: Requirements) -> int:
    """The window a run's prefill captures: what its methods need, at least `DEFAULT_CAPTURE_WINDOW` (as
    before methods declared it; queries beyond a method's window are never read, so results do not change)."""
    return max(DEFAULT_CAPTURE_WINDOW, needs.capture_window)


def prefill_for(model, input_ids, needs: Requirements, reserve: int = 0, context: SampleContext | None = None) -> PrefillState:
    """The one prefill of a prompt, recording what the run's methods need (`Requirements.of_all(methods)`)
    and, of what the sample brings (`context`), what they declared."""
    return prefill(model, input_ids, capture_window=captured_window(needs), reserve=reserve, requirements=needs,
                   context=context)
