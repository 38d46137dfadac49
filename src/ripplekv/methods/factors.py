"""A method's cell in a factorial design: its allocation across layers, its scorer and its head split.

Read from the method's resolved description (`describe()`, as `config.json` records it), never from its label:
`snapkv`, `uniform` and `expected-attention:split=even` name cells of one allocation. A file allocation is
named by its method (`ripplekv`, `depthkv`): the allocator is the same, the file is what differs.
"""

from __future__ import annotations

from ripplekv.defaults import THRESHOLD

REFERENCE_ALLOCATION = "uniform"  # the allocation a main effect of allocation is measured from
ALLOCATION_NAMES = {"uniform": REFERENCE_ALLOCATION, "pyramid": "pyramidkv"}  # the rest: the allocator's name
FILE_ALLOCATOR = "file"
OWN_SPLIT = "curve"  # an allocator that sets per-head counts itself (LU-KV's curve) and was given no split=
EVEN_SPLIT = "even"


def cell_of(label: str, spec: dict) -> tuple[str, str, str] | None:
    """(allocation, scorer, split) of one resolved method; None for one without both parts (full, kivi, ...) and for
    a threshold variant (`methods.core.thresholded`: at no budget, so in no cell beside the budgeted ones)."""
    allocator, scorer = spec.get("allocator"), spec.get("scorer")
    if not isinstance(allocator, dict) or not isinstance(scorer, dict) or not allocator.get("name"):
        return None
    if THRESHOLD in spec or allocator.get("reading") == THRESHOLD:
        return None
    name = allocator["name"]
    allocation = label.split(":", 1)[0] if name == FILE_ALLOCATOR else ALLOCATION_NAMES.get(name, name)
    split = allocator.get("split") or (OWN_SPLIT if sets_head_counts(name) else EVEN_SPLIT)
    return allocation, scorer.get("name", ""), split


def sets_head_counts(allocator_name: str) -> bool:
    """Whether this allocator, given no split=, sets each head's count itself (as it declares)."""
    from ripplekv.methods import ALLOCATORS

    kind = ALLOCATORS.get(allocator_name)
    return kind is not None and kind.splits_itself()


def design(method_specs: dict) -> list[tuple[str, str, str, str]]:
    """(label, allocation, scorer, split) of every method in a run's `method_specs` that has a cell."""
    return [(label, *cell) for label, spec in method_specs.items() if (cell := cell_of(label, spec)) is not None]
