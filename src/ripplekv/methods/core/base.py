"""A compression method turns a prefilled prompt into entries at a budget (the `Method` protocol).

Most methods are an allocator x a scorer (`AllocatorScorer`):
- An **allocator** decides how many entries each (layer, KV head) keeps: an `[L, H_kv]` integer matrix
  that sums exactly to `L * H_kv * B` (or keeps everything when the prompt has n <= B tokens).
- A **scorer** decides which entries a head keeps, given its count (`chunk_rounding=kvpress` keeps kvpress's).
- The method gathers the tokens the scorer keeps (a subclass may merge them instead, see `compress`); a method
  not built from the two (GraceKV's prototype trees) implements the protocol itself.

On a model with sliding-window layers a layer holds at most its window (`PrefillState.capacity`): a scorer's
candidates before it score -inf (`held_only`, applied to every `Scorer.scores`), and an allocator's shares are
fitted to the capacities by one rule for every method (`budgets.fit_layers` before the head split, and
`budgets.fit_to_capacities` on the final counts of allocators that split heads themselves).

Scorers and allocators are small frozen dataclasses registered by name; their fields are the options a
method spec can set (see `methods.core.spec`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar, Protocol

import numpy as np
import torch

from ripplekv.engine import entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.errors import UserError
from ripplekv.methods.core.budgets import capacities_of, check_budget, fit_layers, fit_to_capacities, integer_budgets
from ripplekv.methods.core.registry import (  # noqa: F401 - these and the selection helpers, found here as before
    ALLOCATORS,
    DEFAULT_HEAD_ALPHA,
    HEAD_SPLITS,
    SCORERS,
    register_allocator,
    register_head_split,
    register_scorer,
)
from ripplekv.methods.core.selection import per_head, recent_mask, top_indices, top_scored_mask  # noqa: F401


def layer_allocators() -> list[str]:
    """The allocators a head split composes with (`split=`): those that leave the head split to it, as each
    declares (`Allocator.splits_itself`)."""
    return sorted(name for name, cls in ALLOCATORS.items() if not cls.splits_itself())


def options_of(component) -> dict:
    """A component's resolved options (None-valued ones left out), for config.json."""
    chosen = {}
    for f in fields(component):
        value = getattr(component, f.name)
        if value is None or (f.metadata.get("internal") and not f.metadata.get("record")):
            continue
        chosen[f.name] = list(value) if isinstance(value, tuple) else value
    return chosen


def held_only(state: PrefillState, layer: int, scores: torch.Tensor) -> torch.Tensor:
    """`scores` [.., m] of candidates at positions 0..m-1, with those `layer` cannot hold (a sliding layer's
    positions before its window) at -inf: no selection or competition over scores picks them."""
    start = state.held_from(layer) if hasattr(state, "held_from") else 0
    if start <= 0:
        return scores
    scores = scores.clone()
    scores[..., :start] = float("-inf")
    return scores


def _within_capacity(scores: Callable) -> Callable:
    @functools.wraps(scores)
    def held(self, state, layer):
        return held_only(state, layer, scores(self, state, layer))

    return held


@dataclass(frozen=True)
class Scorer:
    """Which entries a head keeps."""

    def __init_subclass__(cls, **kwargs):
        """Every scorer's `scores` leaves out what a sliding layer cannot hold (`held_only`), so no scorer,
        head split or competition across layers needs to know about windows."""
        super().__init_subclass__(**kwargs)
        if "scores" in cls.__dict__:
            cls.scores = _within_capacity(cls.__dict__["scores"])

    name = "scorer"
    routable = True  # False: cannot be one layer's scorer in a route (the router itself)
    # True: it reads the full cache's answer (a ceiling, not a deployable method); any method using it is one
    knows_answer: ClassVar[bool] = False
    # True: its scores are the same in every KV head of a layer, so a head split by them is the even split
    same_for_every_head: ClassVar[bool] = False
    rounds_counts = False  # True: `keep` keeps its own number of entries (kvpress's whole chunks), not its count

    def unused_options(self) -> dict[str, str]:
        """Options this scorer takes that change nothing with its other options as set: name -> why
        (`presets.make_method` refuses them when a spec sets them)."""
        return {}

    def floor(self) -> int:
        """Entries a layer keeps before any scoring (SnapKV's window); no layer is allocated fewer."""
        return 1

    def keeps_top_scores(self) -> bool:
        """Whether `keep` is the top `count` of `scores` plus the last `window` entries, so a threshold on the
        scores means something (`methods.core.thresholded`); a scorer with its own rule says False."""
        return False

    def requirements(self) -> Requirements:
        """What the prefill must record for this scorer (nothing by default; window scorers override)."""
        return Requirements()

    def degenerate(self, budget: int) -> str | None:
        """What this scorer turns into at `budget` when an option leaves it no choice (None: it chooses)."""
        return None

    def check_layers(self, num_layers: int) -> None:
        """Refuse a model this scorer was not made for (a route lists its layers); most fit any model."""

    def decode_policy(self, every: int):
        """How this scorer evicts while decoding under a total budget (`methods.core.decoding`), re-scoring every
        `every` steps where it re-scores at all; None: it cannot compress while decoding."""
        return None

    def scores(self, state: PrefillState, layer: int) -> torch.Tensor:
        """Float32 scores [H_kv, m] of the scored candidates (higher = keep), comparable across heads."""
        raise NotImplementedError

    def keep(self, state: PrefillState, layer: int, counts: torch.Tensor) -> torch.Tensor:
        """Bool mask [H_kv, n] keeping `counts[h]` entries in head h."""
        raise NotImplementedError


@register_head_split("even")
def even_split(state, per_layer, scorer, alpha) -> np.ndarray:
    return np.repeat(np.asarray(per_layer, dtype=np.int64)[:, None], state.num_kv_heads, axis=1)


# Options every layer allocator takes (a composition's head level); left out of each allocator's own defaults.
COMPOSITION = {"composition": True}
# An option that names a file (an allocation, a route, a fitted profile, curve or surrogate): a method's label
# shows its file name only, and a run's config compares the file's contents, not where it was (`spec.file_options`).
FILE = {"file": True}


@dataclass(frozen=True)
class Allocator:
    """How many entries each (layer, KV head) keeps: per-layer budgets (`layer_budgets`, or
    `prompt_budgets` when they depend on the prompt), then a head split (`split=`: even by default,
    `split=adakv` lets a layer's heads compete by the scorer's scores, with AdaKV's safeguard `head_alpha`)."""

    name = "allocator"
    knows_answer: ClassVar[bool] = False  # True: its budgets read the full cache's answer (a ceiling, as for scorers)
    # True when its budgets depend on the prompt's scores, not only its length (AdaKV, CAKE, the global
    # competitions): the one flag for it; a method is prompt-dependent when its allocator is or splits heads.
    prompt_dependent: ClassVar[bool] = False
    prompt_note = "its per-layer totals are uniform, and its per-head counts are recorded per sample by `ripplekv eval`"
    # True: every layer gets the same budget (its head split aside): it spreads nothing across layers
    same_budget_every_layer: ClassVar[bool] = False
    split: str | None = field(default=None, metadata=COMPOSITION)
    head_alpha: float | None = field(default=None, metadata=COMPOSITION)

    def __post_init__(self):
        self.check_heads()

    @classmethod
    def splits_itself(cls) -> bool:
        """Whether this allocator sets head counts itself (so `split=` does not apply): one that overrides
        `allocate` does, unless it says otherwise."""
        return cls.allocate is not Allocator.allocate

    def takes_split(self) -> bool:
        """Whether `split=` applies to this allocator (a layer allocator; LU-KV's layer totals also take one)."""
        return not self.splits_itself()

    def check_heads(self) -> None:
        if self.split is not None and not self.takes_split():
            raise UserError(f"allocator {self.name} splits heads itself; split= applies to the layer allocators "
                            f"({', '.join(layer_allocators())})")
        if self.split is not None and self.split not in HEAD_SPLITS:
            raise UserError(f"option split must be one of {', '.join(sorted(HEAD_SPLITS))}, got {self.split!r}")
        if self.head_alpha is not None and not 0 <= self.head_alpha <= 1:
            raise UserError(f"option head_alpha must be in [0, 1], got {self.head_alpha!r}")
        if self.head_alpha is not None and self.split in (None, "even"):
            raise UserError("option head_alpha only applies with split=adakv")

    @property
    def splits_heads(self) -> bool:
        return self.split not in (None, "even")

    @property
    def splits_by_scores(self) -> bool:
        """Whether a layer's heads share its budget by the scorer's scores (a head split, or an allocator that is one)."""
        return self.splits_heads

    def unused_options(self) -> dict[str, str]:
        """Options this allocator takes that change nothing with its other options as set: name -> why."""
        return {}

    def layer_weights(self, num_layers: int, budget: int, floor: int) -> list[float]:
        """Real-valued per-layer weights; only proportions matter."""
        return [1.0] * num_layers

    def layer_budgets(self, num_layers: int, budget: int, length: int, floor: int) -> list[int]:
        """Entries per KV head in each layer, summing to `num_layers * budget` exactly."""
        check_budget(budget)
        return integer_budgets(self.layer_weights(num_layers, budget, floor), budget, length, floor)

    def requirements(self) -> Requirements:
        """What the prefill must record for this allocator (nothing by default; CAKE's window overrides)."""
        return Requirements()

    def prompt_budgets(self, state: PrefillState, budget: int, scorer: Scorer) -> list[int]:
        """Entries per KV head in each layer for this prompt (prompt-dependent allocators override)."""
        return self.layer_budgets(state.num_layers, budget, state.length, scorer.floor())

    def allocate(self, state: PrefillState, budget: int, scorer: Scorer) -> np.ndarray:
        """The `[L, H_kv]` budget matrix for one prefilled prompt: layer budgets, then the head split."""
        per_layer = fit_layers(self.prompt_budgets(state, budget, scorer), state.capacities)
        return HEAD_SPLITS[self.split or "even"](state, per_layer, scorer, self.split_alpha())

    def split_alpha(self) -> float | None:
        """The head split's safeguard (None: the split's own default)."""
        return self.head_alpha

    def canonical(self) -> dict:
        """This allocator as the one description shared by every spelling of it (`presets.identity`): its
        name and options, the head split's default safeguard spelt out."""
        described = {"name": self.name, **options_of(self)}
        if self.splits_heads and self.head_alpha is None:
            described["head_alpha"] = DEFAULT_HEAD_ALPHA.get(self.split)
        return described


class Method(Protocol):
    """What engine and pipeline ask of a method: what the prefill must record, and entries at a budget.

    `budgets` and `compress` are called on the same prefill; `layer_budgets` answers without a prompt
    (a UserError when the method's budgets depend on it: `prompt_dependent`). `describe` is everything
    that determines the output (written to config.json). A method that can compress while decoding also
    has `decode_policy(every)` (`methods.core.decoding`); one without it is refused under `--decode-budget total`.
    """

    label: str
    preset: str

    @property
    def name(self) -> str: ...

    @property
    def is_full(self) -> bool: ...

    @property
    def prompt_dependent(self) -> bool: ...

    @property
    def knows_answer(self) -> bool:
        """Whether any part reads the full cache's answer: a ceiling, reported beside methods, never ranked."""
        ...

    def describe(self) -> dict: ...

    def requirements(self) -> Requirements: ...

    def degenerate(self, budget: int) -> str | None:
        """Why this method's options leave it no choice at `budget` (None: they do not)."""
        ...

    def layer_budgets(self, num_layers: int, budget: int, length: int) -> list[int]: ...

    def budgets(self, state: PrefillState, budget: int) -> np.ndarray: ...

    def compress(self, state: PrefillState, budget: int) -> list[entries.LayerEntries]: ...


@dataclass(frozen=True)
class AllocatorScorer:
    """A named, fully resolved method: allocator x scorer (`scorer` None keeps everything: the full cache)."""

    label: str
    preset: str
    allocator: Allocator
    scorer: Scorer | None

    @property
    def name(self) -> str:
        return self.label

    @property
    def is_full(self) -> bool:
        return self.scorer is None

    @property
    def prompt_dependent(self) -> bool:
        """Whether budgets depend on the prompt's scores (not only its length)."""
        return bool(self.allocator.prompt_dependent or self.allocator.splits_heads)

    @property
    def knows_answer(self) -> bool:
        """A ceiling when its allocator or its scorer reads the full cache's answer."""
        return bool(self.allocator.knows_answer or (self.scorer is not None and self.scorer.knows_answer))

    def describe(self) -> dict:
        """Everything that determines this method's output (written to config.json)."""
        if self.is_full:
            return {"preset": self.preset}
        described = {"preset": self.preset, "allocator": {"name": self.allocator.name, **options_of(self.allocator)}}
        if self.scorer is not None:
            described["scorer"] = {"name": self.scorer.name, **options_of(self.scorer)}
        return described

    def requirements(self) -> Requirements:
        """The union of what the allocator and the scorer need from the prefill (nothing for the full cache)."""
        if self.is_full:
            return Requirements()
        return self.allocator.requirements().union(self.scorer.requirements())

    def degenerate(self, budget: int) -> str | None:
        return self.scorer.degenerate(budget) if self.scorer is not None else None

    def check_fitted(self, shape: tuple[int, int, int], bundled: bool) -> None:
        """A part that reads a fitted file (`check_fitted`: LU-KV's curve, KVzap's surrogate) checks it against the
        model's (layers, KV heads, hidden size) before any prefill (`methods.catalog.check_fitted`)."""
        for part in (self.allocator, self.scorer):
            if hasattr(part, "check_fitted"):
                part.check_fitted(shape, bundled, self.scorer)

    def decode_policy(self, every: int):
        """The scorer's decoding-phase eviction (None: the full cache, or a scorer that cannot)."""
        return self.scorer.decode_policy(every) if self.scorer is not None else None

    def floor(self) -> int:
        return self.scorer.floor() if self.scorer is not None else 1

    def layer_budgets(self, num_layers: int, budget: int, length: int | list[int]) -> list[int]:
        """Entries per KV head in each layer (prompt-independent allocators only); `length` is the prompt's, or
        each layer's capacity (`PrefillState.capacities`: a sliding layer holds its window)."""
        caps = capacities_of(length, num_layers)
        if self.is_full:
            return caps
        self.scorer.check_layers(num_layers)
        return fit_layers(self.allocator.layer_budgets(num_layers, budget, max(caps), self.floor()), caps)

    def budgets(self, state: PrefillState, budget: int) -> np.ndarray:
        """The `[L, H_kv]` entry counts kept: the allocation, or what is selected where the scorer `rounds_counts`."""
        if self.scorer is not None and self.scorer.rounds_counts:
            return self.select(state, budget).sum(-1).cpu().numpy().astype(np.int64)
        return self.allocation(state, budget)

    def allocation(self, state: PrefillState, budget: int) -> np.ndarray:
        """The `[L, H_kv]` counts allocated for this prompt, fitted to what each layer can hold."""
        caps = state.capacities
        if self.is_full:
            return np.repeat(np.asarray(caps, dtype=np.int64)[:, None], state.num_kv_heads, axis=1)
        return fit_to_capacities(self.allocator.allocate(state, budget, self.scorer), caps)

    def select(self, state: PrefillState, budget: int) -> torch.Tensor:
        """Bool mask [L, H_kv, n] of the tokens kept (for token-selecting methods)."""
        counts = self.allocation(state, budget)
        masks = []
        for layer in range(state.num_layers):
            layer_counts = torch.as_tensor(counts[layer], device=state.device)
            full = bool((layer_counts >= state.capacity(layer)).all())
            masks.append(held_mask(state, layer) if full else self.scorer.keep(state, layer, layer_counts))
        return torch.stack(masks)

    def compress(self, state: PrefillState, budget: int) -> list[entries.LayerEntries]:
        """Entries per layer; a layer that keeps everything shares the prefill's tensors."""
        if self.is_full:
            return [state.full_entries(layer) for layer in range(state.num_layers)]
        masks = self.select(state, budget)
        return [
            state.full_entries(layer) if bool((mask == held_mask(state, layer)).all())
            else entries.gather(state.keys[layer], state.values[layer], mask)
            for layer, mask in enumerate(masks)
        ]


def held_mask(state: PrefillState, layer: int) -> torch.Tensor:
    """Bool [H_kv, n]: every position `layer` holds (the whole prompt, or a sliding layer's window)."""
    mask = torch.zeros(state.num_kv_heads, state.length, dtype=torch.bool, device=state.device)
    mask[:, state.held_from(layer):] = True
    return mask


def check_integers(values: dict, minimum: int = 1, why: str = "") -> None:
    """Each option must be an integer >= minimum (a bool is not an integer here); one line names the first that is not."""
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"option {key} must be {kind}{f' ({why})' if why else ''}, got {value!r}")


def check_positive(**values: int) -> None:
    check_integers(values)
