"""The named methods (presets), read from the table `methods/presets.toml`: one line per name with the family it is
reported in, its allocator and scorer (or the method class it is built as), its own option defaults and one line
about it. Data, apart from the spec parser (`core.spec`), so a new method is its module plus one table line.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from ripplekv import defaults
from ripplekv.methods.core.base import AllocatorScorer
from ripplekv.methods.core.registry import METHOD_CLASSES

TABLE = Path(__file__).resolve().parents[1] / "presets.toml"
COLUMNS = ("family", "allocator", "scorer", "class", "options", "alias_of", "about")
REQUIRED = ("family", "about")


@dataclass(frozen=True)
class Preset:
    """A named method: an allocator x a scorer (`scorer` None: the full cache), or a registered method class
    (`method_class`): a method of its own (`own`, built from its `Options`) when it is not made of the two, or an
    `AllocatorScorer` subclass (`kind`) that checks more when built."""

    name: str
    family: str
    about: str
    allocator: str | None = None
    scorer: str | None = None
    method_class: str | None = None
    options: tuple = ()  # (key, value) defaults this preset sets on its allocator or scorer (a spec overrides them)
    alias_of: str | None = None  # the canonical spec this name is another name for (`adakv` = `snapkv:split=adakv`)

    def _class(self) -> type | None:
        """The registered method class (looked up when asked: the registry fills as `ripplekv.methods` imports)."""
        if self.method_class is None:
            return None
        if self.method_class not in METHOD_CLASSES:
            raise ValueError(f"preset {self.name!r} names class {self.method_class!r}, which no module registers "
                             f"(registered: {', '.join(sorted(METHOD_CLASSES))})")
        return METHOD_CLASSES[self.method_class]

    @property
    def own(self) -> type | None:
        """The method's own class when it is not an allocator x scorer (GraceKV), else None."""
        cls = self._class()
        return None if cls is None or issubclass(cls, AllocatorScorer) else cls

    @property
    def kind(self) -> type:
        """The class an allocator x scorer preset is built as (`AllocatorScorer`, or a subclass that checks more)."""
        cls = self._class()
        return cls if cls is not None and issubclass(cls, AllocatorScorer) else AllocatorScorer

    @property
    def is_full(self) -> bool:
        return self.method_class is None and self.scorer is None


def preset_of(name: str, row: dict, where: str = "presets.toml") -> Preset:
    """One table line as a Preset; a column the table does not have, or a required one missing, is named."""
    unknown = sorted(set(row) - set(COLUMNS))
    missing = [column for column in REQUIRED if not row.get(column)]
    if unknown or missing:
        raise ValueError(f"{where}: preset {name!r} " + "; ".join(
            ([f"has no column {', '.join(unknown)} (columns: {', '.join(COLUMNS)})"] if unknown else [])
            + ([f"needs {', '.join(missing)}"] if missing else [])))
    return Preset(name, row["family"], row["about"], row.get("allocator"), row.get("scorer"), row.get("class"),
                  tuple(sorted(row.get("options", {}).items())), row.get("alias_of"))


def read_table(text: str, where: str = "presets.toml") -> dict[str, Preset]:
    """name -> Preset for every line of a preset table, in the table's order."""
    return {name: preset_of(name, row, where) for name, row in tomllib.loads(text).items()}


PRESETS: dict[str, Preset] = read_table(TABLE.read_text(encoding="utf-8"), str(TABLE))

# The commands' default choices (ripplekv.defaults) must name presets.
for _chosen in (*defaults.DEFAULT_EVAL_METHODS, *defaults.DEFAULT_ROUTE_CANDIDATES, *defaults.UNIFORM_BASELINES,
                defaults.ALLOCATION_METHOD, defaults.ALLOCATION_PLOT_BESIDE, defaults.EVICTION_METHOD, *defaults.CEILINGS):
    assert _chosen in PRESETS, f"ripplekv.defaults names {_chosen!r}, which is not a preset"


def method_names() -> list[str]:
    return sorted(PRESETS)


def families() -> list[str]:
    """The families the presets are reported in, in the table's order (from the table: no list kept by hand)."""
    return list(dict.fromkeys(chosen.family for chosen in PRESETS.values()))
