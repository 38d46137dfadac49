"""Prefill once with full attention and keep what every compression method needs.

Compressing after a full-attention prefill is what SnapKV, PyramidKV and StreamingLLM do, so one prefill
serves every method and budget: per layer the full K/V (post-RoPE keys, as the model stores them) and the
observation-window queries; on request the signals the methods declared (`Requirements.signals`), each
recorded by the recorder registered under its name (`engine.recorders`) beside the model's attention, so the
prefill itself is the same whichever methods run. Full attention maps are never materialized (tens of GB
at 8k tokens). What a method computes from the prefill and shares across budgets and methods it keeps with
`PrefillState.memo`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from transformers import DynamicCache

from ripplekv.engine import adapter, entries
from ripplekv.engine import cache as kvcache
from ripplekv.engine.linear import few_row_linears
from ripplekv.engine.malloc import keeping_freed_memory
from ripplekv.engine.recorders import WINDOW_QUERIES, FromSample, SampleContext, keep, recorders_for
from ripplekv.errors import UserError

DEFAULT_CAPTURE_WINDOW = 64
T = TypeVar("T")
_NOTHING = object()


@dataclass(frozen=True)
class Requirements:
    """What a method needs the one prefill to record: the observation window's width and the signals it reads
    by name (each recorded by the recorder registered under that name, `engine.recorders.RECORDERS`). A run
    prefills once for the union of its methods' requirements.

    Methods declare these (`Method.requirements()`); engine and pipeline code never ask for a method by name.
    """

    capture_window: int = 0  # the last w prompt tokens' queries (observation windows)
    signals: frozenset[str] = frozenset()  # further signals, by the name their recorder is registered under

    def __post_init__(self):
        object.__setattr__(self, "signals", frozenset(self.signals))

    def union(self, other: Requirements) -> Requirements:
        """What either needs: the wider window, every signal of both."""
        return Requirements(max(self.capture_window, other.capture_window), self.signals | other.signals)

    @staticmethod
    def of_all(items) -> Requirements:
        """The union of the requirements of `items` (anything with a `requirements()` method)."""
        total = Requirements()
        for item in items:
            total = total.union(item.requirements())
        return total


@dataclass
class PrefillState:
    """Everything a method needs from one prompt's prefill: K/V, the last logits, the recorded signals
    (`signal`), and what methods computed from them once for every budget (`memo`)."""

    input_ids: torch.Tensor  # [n]
    keys: list[torch.Tensor]  # per layer [H_kv, n, d]
    values: list[torch.Tensor]
    last_logits: torch.Tensor  # [vocab] next-token logits after the whole prompt
    scaling: float
    model: object = field(default=None, repr=False)  # for methods that need the model's RoPE (via adapter)
    # the recorded signals by name (`engine.recorders`): the window queries always, the rest when declared
    signals: dict = field(default_factory=dict, repr=False)
    memos: dict = field(default_factory=dict, repr=False)  # `memo`'s results, by key
    # per layer, the attention window of a sliding-window layer (None: the layer sees the whole prompt); None
    # when no layer slides. A sliding layer holds only its last `capacity(layer)` prompt entries.
    windows: list | None = None
    _full: dict = field(default_factory=dict, repr=False)

    def signal(self, name: str, default=_NOTHING):
        """The recorded signal `name`; `default` when given and it was not recorded, else one clear line."""
        if name in self.signals:
            return self.signals[name]
        if default is not _NOTHING:
            return default
        raise UserError(f"this prefill did not record the signal {name!r}; the method that reads it must declare "
                        f"it (Requirements(signals={{{name!r}}})) so the prefill records it")

    def memo(self, key: tuple, compute: Callable[[], T]) -> T:
        """`compute()` once per prefill and `key`, shared by every method and budget that asks for the same key.

        `key` is a tuple whose first item is the function or class whose result it is, the rest the options
        that result depends on (`(window_scores, layer, window, kernel, pooling)`), so two components share a
        result exactly when they would compute the same one."""
        if not (isinstance(key, tuple) and key and callable(key[0])):
            raise TypeError(f"a memo key is a tuple (function or class, options...), got {key!r}")
        if key not in self.memos:
            self.memos[key] = compute()
        return self.memos[key]

    def forget(self) -> None:
        """Drop every memoised result (to time or check a method from fresh scores)."""
        self.memos.clear()

    def window_queries(self, layer: int, window: int, who: str = "this method") -> torch.Tensor:
        """The last `window` prompt queries of `layer` [H_q, window, d]; one line when fewer were captured."""
        captured = self.signal(WINDOW_QUERIES)[layer]
        if window > captured.shape[1]:
            raise UserError(f"{who} window {window} exceeds the captured window ({captured.shape[1]}); "
                            f"prefill with Requirements(capture_window={window})")
        return captured[:, captured.shape[1] - window :]

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
        return int(self.signal(WINDOW_QUERIES)[0].shape[0])


@torch.inference_mode()
def prefill(
    model, input_ids, capture_window: int = DEFAULT_CAPTURE_WINDOW, reserve: int = 0,
    requirements: Requirements | None = None, context: SampleContext | None = None,
) -> PrefillState:
    """Run the prompt once with full attention; keep K/V, window queries, the last logits and the signals asked.

    `reserve`: tokens that will follow the prompt (the answer), checked against the model's window.
    `requirements`: what the methods to be run need (`Requirements.of_all`); it widens the captured window
    and turns on the recorder of each signal it names (`engine.recorders`). `context`: what the sample
    brings beside its tokens (tokenizer, question), kept only where a signal asks.
    Whatever is recorded, the model's own attention computes the prefill: K/V and logits do not change.
    """
    needs = (requirements or Requirements()).union(Requirements(capture_window=capture_window))
    kvcache.install(model)
    few_row_linears(model)  # the decoding that follows runs most steps on a few variants
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(adapter.device(model))
    adapter.check_length(model.config, len(ids), reserve)
    recorders = recorders_for(needs, model, len(ids), needs.capture_window, context)
    # A plain cache keeps every prompt position in every layer (a model's own would cut sliding layers to their
    # window); the attention masks, sliding ones included, are the model's, so K/V and logits do not change.
    watching = [recorder for recorder in recorders if not isinstance(recorder, FromSample)]
    hooks = [hook for recorder in watching for hook in recorder.attach(model)]
    try:
        with keeping_freed_memory():
            out = model(input_ids=ids[None], cache=DynamicCache(), use_cache=True, logits_to_keep=1,
                        ripplekv_recorders=watching)
    finally:
        for hook in hooks:
            hook.remove()
    dyn = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
    num_layers = model.config.num_hidden_layers
    windows = adapter.layer_windows(model.config)
    state = PrefillState(
        input_ids=ids,
        keys=[dyn.layers[i].keys[0] for i in range(num_layers)],
        values=[dyn.layers[i].values[0] for i in range(num_layers)],
        last_logits=out.logits[0, -1].float(),
        scaling=adapter.attention_scaling(model),
        model=model,
        windows=windows if any(window is not None for window in windows) else None,
    )
    for recorder in recorders:
        keep(state, recorder.signal, recorder.result(num_layers))
    return state


def captured_window(needs: Requirements) -> int:
    """The window a run's prefill captures: what its methods need, at least `DEFAULT_CAPTURE_WINDOW` (as
    before methods declared it; queries beyond a method's window are never read, so results do not change)."""
    return max(DEFAULT_CAPTURE_WINDOW, needs.capture_window)


def prefill_for(model, input_ids, needs: Requirements, reserve: int = 0, context: SampleContext | None = None) -> PrefillState:
    """The one prefill of a prompt, recording what the run's methods need (`Requirements.of_all(methods)`)
    and, of what the sample brings (`context`), what they declared."""
    return prefill(model, input_ids, capture_window=captured_window(needs), reserve=reserve, requirements=needs,
                   context=context)
