"""The variants of one prefill as an engine service: allocate, plan groups in memory, build, decode, release.

A variant is a method at a budget (`Variant`). Once a prompt is prefilled and the full cache has answered,
`decode_variants` runs them all, as `ripplekv eval`, the Python API and the benchmarks do:
1. allocate: each variant's entry counts per (layer, KV head) (its method's budgets, timed as its build);
2. plan: the bytes left beside what the sample's own tensors hold (`memory.variant_room`; a variant that
   cannot decode even alone is a UserError before any decoding) and groups of similar kept length within them,
   never from the process's measured memory, so a resumed sample decodes in the groups (and gives the numbers)
   of an uninterrupted run;
3. build a group's entries only when it decodes (`memory.LazyVariants`), decode it, release it with its cache;
4. re-plan the variants left from the sample's tensors then (`memory.room_left`: scores a build cached, the
   allocator's keep).
Under a total decode budget every variant decodes with its own method's eviction policy (`engine.budgeted`).
`SampleMemory` is the sample's byte budget and the meter of its peak, started before its prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine import adapter, timings
from ripplekv.engine.decode import Fidelity, Reference
from ripplekv.engine.evict import capacities
from ripplekv.engine.malloc import allow_keeping, return_freed_memory
from ripplekv.engine.memory import (
    LazyVariants,
    PeakMemory,
    default_budget,
    held_bytes,
    note_prefill_over,
    room_left,
    variant_room,
)
from ripplekv.engine.prefill import PrefillState

DEFAULT_COMPRESS_EVERY = 8  # ours: re-scoring methods (SnapKV's scorer) score the held entries again every 8 steps


@dataclass(frozen=True)
class Variant:
    """A method (anything with `budgets`, `compress` and, under a total budget, `decode_policy`) at a budget."""

    label: str
    budget: int
    method: object

    def __str__(self) -> str:
        return f"{self.label} at budget {self.budget}"


@dataclass(frozen=True)
class Decoding:
    """How variants decode: `decoding` "divergence" decodes a variant only after its first disagreement with the
    full answer (`engine.divergence`), "plain" decodes every variant whole; `decode_budget` "total" holds every
    (layer, KV head) at its count while decoding (`engine.evict`), re-scoring every `compress_every` steps where
    a method re-scores; `batch_size` variants at most per teacher-forced pass."""

    max_new_tokens: int
    batch_size: int = EVAL_BATCH_SIZE
    decoding: str = "divergence"
    decode_budget: str = "prompt"
    compress_every: int = DEFAULT_COMPRESS_EVERY

    @property
    def total(self) -> bool:
        return self.decode_budget == "total"

    @property
    def phases(self) -> tuple[str, ...]:
        """The timing phases the variants decode in."""
        return timings.DECODES["total" if self.total else self.decoding]


@dataclass
class Decoded:
    """One variant's outcome: its entry counts [L, H_kv], greedy tokens, fidelity to the full cache, and under a
    total budget the capacity each (layer, KV head) was held at."""

    variant: Variant
    counts: np.ndarray
    tokens: list[int]
    fidelity: Fidelity
    capacity: np.ndarray | None = None


class SampleMemory:
    """What one sample may hold and what it held: its byte budget (default `memory.default_budget`: the weights
    plus most of what is free), the weights' bytes, and the meter of its peak from the moment it is made (before
    the prefill; on CPU the resident set, with freed blocks handed back so a finished group leaves it: the peak
    each line records, never what groups are planned from)."""

    def __init__(self, model, budget: int | None = None):
        device = adapter.device(model)
        if device.type == "cpu":
            return_freed_memory()
            allow_keeping(budget is None)  # a budget the user set: its long forwards keep no freed block either
        self.meter = PeakMemory(device)
        self.weights = held_bytes(device, model)
        self.budget = budget or default_budget(device, self.weights)

    def peak(self) -> int:
        return self.meter.peak()


def infeasible_variants(variants: Sequence[Variant], state) -> dict[tuple[str, int], str]:
    """(method, budget) -> why, for the variants whose bytes cannot fit their budget on this prompt (a method
    that stores its entries quantized says so through `infeasible`; eviction always fits)."""
    refused = {}
    for one in variants:
        check = getattr(one.method, "infeasible", None)
        why = check(state, one.budget) if check is not None else None
        if why:
            refused[(one.label, one.budget)] = why
    return refused


def build(state: PrefillState, variant: Variant, counts: np.ndarray | None = None) -> list:
    """A variant's entries per layer (timed as its build); `counts`, when given, must be what they hold."""
    with timings.phase(timings.BUILD, variant.label):
        built = variant.method.compress(state, variant.budget)
    if counts is not None:
        kept = entry_counts(built)
        assert (kept == counts).all(), f"{variant}: built entries differ from the allocated budgets"
    return built


def entry_counts(built: list) -> np.ndarray:
    """[L, H_kv] entries each layer's heads hold."""
    return np.array([[int(c) for c in layer.counts.tolist()] for layer in built], dtype=np.int64)


def planned_counts(state: PrefillState, variants: Sequence[Variant], memory: SampleMemory):
    """(each variant's [L, H_kv] counts, each layer's entries padded across heads), after noting a prefill (and
    reference) whose peak is over the memory budget. A method's allocation is timed as part of its build."""
    prefilled = memory.weights + max(0, memory.meter.mark() - memory.meter.origin)  # prefill's and reference's peak
    if prefilled > memory.budget:
        note_prefill_over(state.length, prefilled, memory.budget)
    counts = []
    for variant in variants:
        with timings.phase(timings.BUILD, variant.label):
            counts.append(variant.method.budgets(state, variant.budget))
    return counts, [[int(c) for c in count.max(1)] for count in counts]


def decode_variants(model, state: PrefillState, reference: Reference, variants: Sequence[Variant], decoding: Decoding,
                    memory: SampleMemory, stops=(), question: Sequence[int] = ()) -> list[Decoded]:
    """Every variant's tokens and fidelity, from the one prefill in `state`, in `variants`' order (see above).

    `reference`: the full cache's answer (after `question`, read through each compressed cache first).
    `memory`: the sample's budget and meter, started before the prefill."""
    question = list(question)
    counts, lengths = planned_counts(state, variants, memory)
    scorers = len({id(variant.method) for variant in variants})
    room = variant_room(model, state, reference, [str(v) for v in variants], lengths, scorers, memory.budget,
                        len(question), decoding.max_new_tokens)

    def room_now() -> int:  # between groups, from the sample's tensors then (never the process's history)
        return room_left(model, state, reference, lengths, scorers, memory.budget)

    lazy = LazyVariants(lengths, lambda index: build(state, variants[index], counts[index]))
    caps = [capacities(count, variant.budget) for count, variant in zip(counts, variants)] if decoding.total else None
    if decoding.total:
        from ripplekv.engine.budgeted import decode_in_budget

        policies = [variant.method.decode_policy(decoding.compress_every) for variant in variants]
        tokens, quality = decode_in_budget(model, state, lazy, policies, caps, reference, decoding.max_new_tokens,
                                           stops, decoding.batch_size, room)
    else:
        from ripplekv.engine.divergence import decode_variants as decode

        tokens, quality = decode(model, state, lazy, reference, decoding, stops, prefix=question, memory_bytes=room,
                                 room_after=room_now)
    return [Decoded(variant, count, out, fid, caps[index] if caps else None)
            for index, (variant, count, out, fid) in enumerate(zip(variants, counts, tokens, quality))]
