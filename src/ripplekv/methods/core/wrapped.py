"""Options any method takes that change what its kept entries hold, not which entries it keeps: `merge=` (fold the
evicted entries' values into the kept ones, `methods.core.merging`) and `rerotate=1` (kept keys re-rotated to
contiguous positions, `methods.core.rerotation`).

The wrapped method keeps exactly the entries it kept before (the same counts, so the same exact budgets); each
wrapper builds them with the method's own `compress` and then rewrites their values or keys. A quantizer or key
channels (`quant=`, `think=`) wrap the result, so they store what was merged or re-rotated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.engine import entries as kv_entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.errors import UserError

MERGE_RULES = ("kvpress", "cam")
OPTIONS = ("merge", "rerotate")
ENTRY_HELP = ("entry options (any method that keeps tokens): merge=kvpress (each evicted value folded into the kept "
              "entry whose key is most alike, kvpress MergingPress) or merge=cam (into the next 32 kept entries, "
              "weighted by attention, CaM); rerotate=1 (kept keys re-rotated to contiguous positions, kvpress "
              "KeyRerotationPress); the entries kept, and so the budgets, are the method's own")


@dataclass(frozen=True)
class Wrapped:
    """A method whose kept entries are rewritten after it builds them; everything else is the method's own."""

    label: str
    inner: object  # a Method

    option = ""  # the spec option this wrapper stands for

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "inner":  # copying and pickling ask before `inner` exists
            raise AttributeError(name)
        return getattr(self.inner, name)  # the allocator, the scorer, select, floor ... are the method's

    @property
    def name(self) -> str:
        return self.label

    @property
    def preset(self) -> str:
        return self.inner.preset

    @property
    def is_full(self) -> bool:
        return False

    @property
    def prompt_dependent(self) -> bool:
        return bool(self.inner.prompt_dependent)

    @property
    def knows_answer(self) -> bool:
        return bool(self.inner.knows_answer)

    def own(self) -> dict:
        """This wrapper's part of `describe()`."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {**self.inner.describe(), self.option: self.own()}

    def requirements(self) -> Requirements:
        return self.inner.requirements()

    def degenerate(self, budget: int) -> str | None:
        return self.inner.degenerate(budget)

    def layer_budgets(self, num_layers: int, budget: int, length) -> list[int]:
        return self.inner.layer_budgets(num_layers, budget, length)

    def budgets(self, state: PrefillState, budget: int):
        return self.inner.budgets(state, budget)

    def decode_policy(self, every: int):
        """None: what is merged or re-rotated is the prompt's entries; eviction while decoding would not be."""
        return None

    def rewrite(self, state: PrefillState, layer: int, built: kv_entries.LayerEntries) -> kv_entries.LayerEntries:
        raise NotImplementedError

    def compress(self, state: PrefillState, budget: int) -> list[kv_entries.LayerEntries]:
        built = self.inner.compress(state, budget)
        if any(layer.log_weights is not None or layer.spans is not None for layer in built):
            raise UserError(f"{self.label}: {self.inner.label} builds prototypes, not tokens; {self.option}= applies "
                            "to methods that keep prompt tokens")
        return [self.rewrite(state, layer, entries) for layer, entries in enumerate(built)]


def held_positions(state: PrefillState, layer: int):
    """The first prompt position `layer` holds (a sliding layer: its window's) and the prompt's length."""
    start = state.held_from(layer) if hasattr(state, "held_from") else 0
    return start, state.length
