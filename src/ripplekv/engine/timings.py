"""Where a sample's time goes: wall seconds per phase (prefill, each recorder, each method's build, decodes).

`collect(device)` turns measuring on for the code it wraps; inside it, `phase(name, method)` blocks add their
wall seconds to `Timings`. Phases nest (a method's build runs inside the teacher-forced pass that needs its
entries, a recorder inside the prefill), and each phase keeps only its *own* time: a nested phase's seconds
are taken off its parent's, so a sample's phases add up to its wall time, the rest landing in `other`.
Outside `collect`, `phase` does nothing, so the engine's call sites cost nothing in tests and tools.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from time import perf_counter

import torch

PREFILL = "prefill"  # the model's forward over the prompt, its recorders left out
RECORDER = "recorder "  # + the signal it records: "recorder accumulated_attention"
BUILD = "build"  # a method's budgets and entries (its scorer's passes and trees included); method column set
REFERENCE_DECODE = "reference decode"  # the full cache's greedy answer
TEACHER_FORCED = "teacher-forced"  # the variants' caches assembled and fed the full answer (KL, agreement)
DIVERGENCE_DECODE = "divergence decode"  # variants decoded on from their first disagreement
PLAIN_DECODE = "plain decode"  # `--decoding plain`: every variant decoded whole
BUDGETED_DECODE = "budgeted decode"  # `--decode-budget total`: greedy and forced rows in one evicting batch
OTHER = "other"  # the sample's time outside every phase above (prompt, grouping, scoring, result lines)
REPORT = "report"  # the run's report, once per `eval` (no sample)
# the phases variants decode in, by decoding ("divergence", "plain") or under `--decode-budget total`
DECODES = {"divergence": (TEACHER_FORCED, DIVERGENCE_DECODE), "plain": (PLAIN_DECODE, TEACHER_FORCED),
           "total": (BUDGETED_DECODE,)}

_ACTIVE: ContextVar[Timings | None] = ContextVar("ripplekv_timings", default=None)


def synchronize(device) -> None:
    """Wait for queued CUDA work before reading the clock (CPU work is synchronous already)."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


class Timings:
    """Seconds per (phase, method) of one sample; `method` is "" for the phases all variants share."""

    def __init__(self, device=None):
        self.device = device
        self.seconds: dict[tuple[str, str], float] = {}
        self._nested: list[float] = []  # per open phase: seconds its nested phases took

    def rows(self) -> list[tuple[str, str, float]]:
        """(phase, method, seconds) in the order the phases first ran."""
        return [(name, method, seconds) for (name, method), seconds in self.seconds.items()]


@contextmanager
def phase(name: str, method: str = "") -> Iterator[None]:
    """Count the wrapped block's own wall seconds under (name, method), when `collect` is on."""
    timings = _ACTIVE.get()
    if timings is None:
        yield
        return
    synchronize(timings.device)
    start = perf_counter()
    timings._nested.append(0.0)
    try:
        yield
    finally:
        synchronize(timings.device)
        elapsed = perf_counter() - start
        own = elapsed - timings._nested.pop()
        key = (name, str(method))
        timings.seconds[key] = timings.seconds.get(key, 0.0) + max(own, 0.0)
        if timings._nested:
            timings._nested[-1] += elapsed


def declare(*names: str) -> None:
    """Record `names` at 0 s until they run, so that every sample lists every shared phase of its mode, those
    it had nothing to do in included (no variant diverged: no divergence decode)."""
    timings = _ACTIVE.get()
    if timings is not None:
        for name in names:
            timings.seconds.setdefault((name, ""), 0.0)


@contextmanager
def collect(device=None) -> Iterator[Timings]:
    """Measure the phases of the wrapped block (one sample); its time outside them is `other`."""
    timings = Timings(device)
    token = _ACTIVE.set(timings)
    try:
        with phase(OTHER):
            yield timings
    finally:
        _ACTIVE.reset(token)
