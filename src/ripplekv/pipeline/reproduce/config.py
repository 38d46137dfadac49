"""A reproduce config (configs/NAME.toml), read once: every setting's kind and range checked as it is parsed.

A mistake (a typo in a name, a count of 0, a ratio below 1) ends in one line naming the setting, before any
model work; what needs the model's config or the method registry is checked next (`checks`). An optional
stage runs when its setting is present (e.g. `evict_calib_samples` turns DepthKV's stages on).
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from ripplekv.errors import UserError

# Kinds: count (an integer >= 1), count0 (>= 0), number, text, names (a list of strings), texts (of one word each,
# commas allowed), grids (of `tune`), budgets and ints
# (lists of positive integers), budget (one), ratios (a list of numbers >= 1).
KINDS = {
    "model": "text", "out": "text", "draws": "count", "draw_budgets": "budgets",
    "calib_samples": "count", "seeds": "count", "eta": "number", "probe_tokens": "count",
    "ratios": "ratios", "sweep_samples": "count", "sweep_budget": "budget", "tune": "grids",
    "evict_calib_samples": "count", "prune_ratio": "number", "depthkv_floor": "number",
    "headline_methods": "names", "headline_limit": "count",
    "compresskv_calib_samples": "count", "lukv_calib_samples": "count",
    "route_calib_samples": "count", "route_budget": "budget", "placements": "count0", "placement_samples": "count0",
    "suite": "text", "tasks": "names", "budgets": "budgets", "methods": "names", "limit": "count",
    "target_tokens": "count",
    "compare_methods": "names", "compare_limit": "count", "compare_budgets": "budgets",
    "memory_methods": "names", "memory_limit": "count", "memory_budgets": "budgets",
    "context_methods": "names", "context_limit": "count", "context_budgets": "budgets",
    "long_tasks": "names", "long_methods": "names", "long_budgets": "budgets", "long_limit": "count",
    "long_target_tokens": "count",
    "multi_methods": "names", "multi_tasks": "names", "multi_budgets": "budgets", "multi_limit": "count",
    "needle_lengths": "ints", "needle_limit": "count", "needle_budget": "budget", "needle_methods": "names",
    "carry": "names",
}
REQUIRED = ("out", "calib_samples", "seeds", "eta", "probe_tokens", "ratios", "sweep_samples", "sweep_budget", "suite",
            "budgets", "methods", "limit", "target_tokens")
# A stage's settings it cannot run without: the setting that turns it on -> those it then needs.
NEEDS = {"route_calib_samples": ("route_budget",),
         "context_methods": ("context_budgets", "context_limit"),
         "long_tasks": ("long_methods", "long_budgets", "long_limit", "long_target_tokens"),
         "multi_methods": ("multi_budgets", "multi_limit")}
# Numbers' open or closed ranges: setting -> (low, high, closed).
RANGES = {"prune_ratio": (0.0, 1.0, False), "depthkv_floor": (0.0, 1.0, True)}


@dataclass(frozen=True)
class ReproduceConfig:
    """The settings of one reproduce config (None: not set). `path` is the file, `name` its stem."""

    path: str
    out: str
    calib_samples: int
    seeds: int
    eta: float
    probe_tokens: int
    ratios: tuple
    sweep_samples: int
    sweep_budget: int
    suite: str
    budgets: tuple
    methods: tuple
    limit: int
    target_tokens: int
    model: str | None = None
    draws: int | None = None
    draw_budgets: tuple | None = None
    tune: tuple | None = None
    evict_calib_samples: int | None = None
    prune_ratio: float | None = None
    depthkv_floor: float | None = None
    headline_methods: tuple | None = None
    headline_limit: int | None = None
    compresskv_calib_samples: int | None = None
    lukv_calib_samples: int | None = None
    route_calib_samples: int | None = None
    route_budget: int | None = None
    placements: int | None = None
    placement_samples: int | None = None
    tasks: tuple | None = None
    compare_methods: tuple | None = None
    compare_limit: int | None = None
    compare_budgets: tuple | None = None
    memory_methods: tuple | None = None
    memory_limit: int | None = None
    memory_budgets: tuple | None = None
    context_methods: tuple | None = None
    context_limit: int | None = None
    context_budgets: tuple | None = None
    long_tasks: tuple | None = None
    long_methods: tuple | None = None
    long_budgets: tuple | None = None
    long_limit: int | None = None
    long_target_tokens: int | None = None
    multi_methods: tuple | None = None
    multi_tasks: tuple | None = None
    multi_budgets: tuple | None = None
    multi_limit: int | None = None
    needle_lengths: tuple | None = None
    needle_limit: int | None = None
    needle_budget: int | None = None
    needle_methods: tuple | None = None
    carry: tuple | None = None

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def draw_count(self) -> int:
        return self.draws or 1


assert set(KINDS) == {f.name for f in fields(ReproduceConfig)} - {"path"}


def text(value) -> str:
    """A setting's value as a command line takes it (`0.3`, `128`)."""
    return repr(value) if isinstance(value, float) else str(value)


def joined(values) -> str:
    """A names setting as one comma-joined option (`--methods full,snapkv`)."""
    return ",".join(str(v) for v in values)


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def _integer(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name} = {_shown(value)} must be an integer >= {minimum}")
    return value


def _number(name: str, value, low: float, high: float, closed: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    inside = ok and (low <= value <= high if closed else low < value < high)
    if not inside:
        raise UserError(f"{name} = {_shown(value)} must be a number in {'[' if closed else '('}{low:g}, {high:g}"
                        f"{']' if closed else ')'}")
    return value


def _listed(name: str, value) -> list:
    if not isinstance(value, list):
        raise UserError(f"{name} = {_shown(value)} must be a list, e.g. {name} = [...]")
    return value


def parse(name: str, value, kind: str):
    """One setting's value, checked against its kind; empty (`""`, `[]`) is unset."""
    from ripplekv.pipeline.profile import MAX_ETA

    if value == "" or value == []:
        return None
    if kind == "count":
        return _integer(name, value, 1)
    if kind == "count0":
        return _integer(name, value, 0)
    if kind == "budget":
        return _integer(name, value, 1)
    if kind == "number":
        low, high, closed = RANGES.get(name, (0.0, MAX_ETA, False))  # eta: (0, MAX_ETA)
        return _number(name, value, low, high, closed)
    if kind == "text":
        if not isinstance(value, str):
            raise UserError(f"{name} = {_shown(value)} must be text in quotes")
        return value
    items = _listed(name, value)
    if kind == "grids":  # `ripplekv tune`'s grids, each one word (commas inside)
        if not all(isinstance(v, str) and v.strip() and not any(c.isspace() for c in v.strip()) for v in items):
            raise UserError(f"{name} = {_shown(value)} must list grids in quotes, each without spaces")
        return tuple(v.strip() for v in items)
    if kind == "texts":  # a list of one-word items that may hold commas (`ruler:vt,cwe`)
        if not all(isinstance(v, str) and v.strip() and not any(c.isspace() for c in v.strip()) for v in items):
            raise UserError(f"{name} = {_shown(value)} must list items in quotes, each without spaces")
        return tuple(v.strip() for v in items)
    if kind == "names":
        if not all(isinstance(v, str) and v.strip() and "," not in v for v in items):
            raise UserError(f"{name} = {_shown(value)} must list names in quotes, one an item (no commas inside)")
        return tuple(v.strip() for v in items)
    if kind == "ratios":
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1:
                raise UserError(f"{name} = {_shown(value)}: {_shown(v)} is not a ratio >= 1")
        return tuple(items)
    for v in items:  # budgets, ints
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{name} = {_shown(value)}: {_shown(v)} is not a positive integer")
    return tuple(items)


def read_settings(path: str | Path, kinds: dict[str, str], required: tuple[str, ...],
                  needs: dict[str, tuple[str, ...]], guide: str) -> dict:
    """A pipeline's TOML config as {setting: value}, each checked against `kinds` (a setting -> its kind), the
    `required` ones present and each setting of `needs` (setting -> those its stage needs) with its needs;
    `guide`: the config file that describes every setting (named in the errors)."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise UserError(f"cannot read the config ({err.strerror or err}); pass a file such as configs/quick.toml") \
            from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"not valid TOML: {err}") from None
    for key in raw:
        if key not in kinds:
            close = difflib.get_close_matches(key, kinds, n=1)
            raise UserError(f"unknown setting {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                            + f"; {guide} describes every setting")
    values = {key: parse(key, value, kinds[key]) for key, value in raw.items()}
    for key in required:
        if values.get(key) is None:
            raise UserError(f"{key} is not set; every config sets it (see {guide})")
    for key, wanted in needs.items():
        missing = [need for need in wanted if values.get(key) is not None and values.get(need) is None]
        if missing:
            raise UserError(f"{key} runs a stage that needs {', '.join(missing)}; set it")
    return values


def load_config(path: str | Path) -> ReproduceConfig:
    """configs/NAME.toml, parsed and its settings checked one by one (UserError on the first mistake)."""
    values = read_settings(path, KINDS, REQUIRED, NEEDS, "configs/reproduce.toml")
    for kept in values.get("carry") or ():
        if "/" in kept or kept in (".", ".."):
            raise UserError(f"carry: {kept!r} is not a folder name inside out (e.g. gemma3)")
    return ReproduceConfig(path=str(path), **values)
