"""What the one prefill records for the methods that asked: recorders registered by signal name.

The prefill runs the model's own attention (sdpa). `ripplekv_attention` hands each layer's queries, keys and
values (post-RoPE) to the recorders passed as `ripplekv_recorders=` and returns sdpa's output unchanged, so
no method's signal changes what another method, or the full-cache reference, sees. A signal that is not
attention is a recorder too (`FromSample`): what a sample brings beside its tokens (`SampleContext`: the
tokenizer, the question read after the prompt or where it starts inside it), kept only when a method declared it.

A method declares the signals it reads by name (`Requirements.signals`); the recorder of each is registered
under that name in `RECORDERS` (`register_recorder`), beside the method that needs it in `methods/`, and
its result is read back with `PrefillState.signal(name)`. A new signal is its recorder and the scorer that
reads it: no engine file changes. The engine registers one signal itself, the observation window's queries
(`WINDOW_QUERIES`), which every prefill records at the width the methods ask (`Requirements.capture_window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ripplekv.errors import UserError

WINDOW_QUERIES = "window_queries"  # per layer [H_q, w, d]: the last w prompt queries (observation windows)


@dataclass(frozen=True)
class SampleContext:
    """What a sample brings beside its prompt tokens, for the recorders that keep a part of it."""

    tokenizer: object = None  # the prompt's tokenizer
    question: tuple[int, ...] = ()  # tokens read after the compressed prompt before the answer (context-only)
    # where the part after the context (the question, the instructions after it) begins inside the compressed
    # prompt: the task's own context/question split (with-question); None where the prompt holds no such part
    question_at: int | None = None


@dataclass(frozen=True)
class Setup:
    """What a recorder is made from: the prefill it watches and what the sample brings."""

    model: object
    length: int  # prompt tokens
    window: int  # the observation window captured (`Requirements.capture_window`, at most `length`)
    sample: SampleContext


class Recorder:
    """One signal: reads every prefill attention call (`layer`), then gives its result (`result`).

    Made as `cls(setup)` for each prefill that needs it. `signal` is the name it is registered under and
    its result's name on the state. `answered` updates a recorded result once the full cache's answer is
    decoded (a signal that needs the answer; most ignore it)."""

    signal: ClassVar[str] = ""

    def __init__(self, setup: Setup):
        self.setup = setup

    def layer(self, index: int, query, key, value, attention_mask, scaling: float) -> None:
        """Called by each layer's attention with its post-RoPE tensors ([1, H, n, d]); must not change them."""

    def result(self, num_layers: int):
        return None

    @classmethod
    def answered(cls, recorded, tokens: tuple[int, ...]):
        """The recorded result once the full cache's answer (`tokens`) is known; unchanged by default."""
        return recorded

    def attach(self, model) -> list:
        """Hooks this recorder sets on the model for the prefill's one forward (removed after it); most need none."""
        return []


class PerLayer(Recorder):
    """A recorder whose result is one object per layer."""

    def __init__(self, setup: Setup):
        super().__init__(setup)
        self.layers: dict[int, object] = {}

    def result(self, num_layers: int) -> list:
        return [self.layers[i] for i in range(num_layers)]


class FromSample(Recorder):
    """A signal taken from what the sample brings (`Setup.sample`), not from attention: `value(sample)`;
    nothing is kept when it gives None."""

    def value(self, sample: SampleContext):
        raise NotImplementedError

    def result(self, num_layers: int):
        return self.value(self.setup.sample)


RECORDERS: dict[str, type[Recorder]] = {}


def register_recorder(name: str):
    """A class decorator filing a recorder under its signal `name`; a second, different recorder under a
    name already taken is refused (the same class defined again, as a module reload does, is not)."""

    def wrap(cls: type[Recorder]) -> type[Recorder]:
        known = RECORDERS.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"signal {name!r} already has a recorder ({known.__module__}.{known.__qualname__}); "
                             f"{cls.__module__}.{cls.__qualname__} must record under another name")
        cls.signal = name
        RECORDERS[name] = cls
        return cls

    return wrap


@register_recorder(WINDOW_QUERIES)
class WindowQueries(PerLayer):
    """The last `window` prompt queries per layer [H_q, w, d] (SnapKV's observation window)."""

    def layer(self, index, query, key, value, attention_mask, scaling):
        self.layers[index] = query[0, :, -self.setup.window :, :].detach().clone()


def recorder_of(name: str) -> type[Recorder]:
    """The recorder registered for signal `name`; one line when none is."""
    if name not in RECORDERS:
        known = ", ".join(sorted(RECORDERS))
        raise UserError(f"no recorder is registered for the signal {name!r} (registered: {known}); "
                        "register one with engine.recorders.register_recorder beside the method that reads it")
    return RECORDERS[name]


def recorders_for(needs, model, length: int, window: int, context: SampleContext | None = None) -> list[Recorder]:
    """The recorders a prefill of `length` tokens runs for `needs` (the window queries always), in name order."""
    setup = Setup(model, length, min(window, length), context or SampleContext())
    names = [WINDOW_QUERIES, *sorted(set(needs.signals) - {WINDOW_QUERIES})]
    return [recorder_of(name)(setup) for name in names]


def record_context(state, needs, context: SampleContext) -> None:
    """Keep what `context` brings that `needs` asks for on a state built without a prefill (tests, tools)."""
    setup = Setup(state.model, state.length, 0, context)
    for name in sorted(needs.signals):
        recorder = recorder_of(name)
        if issubclass(recorder, FromSample):
            keep(state, name, recorder(setup).result(state.num_layers))


def keep(state, name: str, recorded) -> None:
    """Put a recorder's result on the state (a result of None is not kept: the signal was not available)."""
    if recorded is not None:
        state.signals[name] = recorded


def record_reference(state, tokens) -> None:
    """The full cache's answer, once decoded, to every recorded signal that takes it (`Recorder.answered`);
    a no-op when none does (so callers need not know which methods ran)."""
    answer = tuple(int(t) for t in tokens)
    for name, recorded in list(state.signals.items()):
        if name in RECORDERS:
            state.signals[name] = RECORDERS[name].answered(recorded, answer)
