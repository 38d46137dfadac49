"""Named methods (presets of allocator x scorer) and the one parser for method specs.

A spec is a preset name with optional options: `snapkv`, `snapkv:window=16:kernel=5`,
`ripplekv:scorer=random`, `pyramidkv:beta=10`. `allocator=` and `scorer=` swap a component; every other
option sets a field of the allocator or the scorer. An option neither has is a one-line error (never
silently dropped). The spec, with its options sorted, is the method's label in every output; a file
option (`depthkv:allocation=runs/x/depthkv.csv`) shows only its file name there, so a label does not
change when a run's folder moves (the full path is in the config's method_specs).

Compositions use the same grammar: every layer allocator takes `heads=adakv` (and `head_alpha=`), so
`ripplekv:heads=adakv:scorer=criticalkv` is RippleKV's layer budgets x AdaKV's head split x CriticalKV's
scores. A preset may set its own option defaults (`defensivekv` runs AdaKV's split with alpha=0); a spec's
options override them.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.methods.base import ALLOCATORS, SCORERS, Method
from ripplekv.methods.gracekv import GraceKV


@dataclass(frozen=True)
class Preset:
    name: str
    allocator: str
    scorer: str | None
    about: str
    kind: type = Method  # a Method subclass for methods that build their own entries (merging)
    options: tuple = ()  # (key, value) defaults this preset sets on its allocator or scorer (a spec overrides them)


PRESETS: dict[str, Preset] = {}
# Options naming a file: labels show the file name only.
FILE_OPTIONS = ("allocation", "route")


def preset(name: str, allocator: str, scorer: str | None, about: str, kind: type = Method, **options) -> None:
    PRESETS[name] = Preset(name, allocator, scorer, about, kind, tuple(sorted(options.items())))


preset("full", "uniform", None, "every entry of every layer (the reference)")
preset("uniform", "uniform", "snapkv", "the design card's uniform baseline: SnapKV at the same budget in every layer")
preset("snapkv", "uniform", "snapkv", "SnapKV: uniform budgets, window attention scores")
preset("pyramidkv", "pyramid", "snapkv", "PyramidKV: budgets linear in depth, SnapKV scores")
preset("ripplekv", "file", "snapkv", "RippleKV: budgets from a sensitivity allocation (--allocation), SnapKV scores")
preset("streamingllm", "uniform", "recency", "StreamingLLM: 4 attention sinks + the most recent tokens")
preset("random", "uniform", "random", "the window + random prefix entries (a floor for sanity)")
preset("adakv", "adakv", "snapkv", "AdaKV: a layer's heads compete for its budget by SnapKV scores")
preset("h2o", "uniform", "h2o", "H2O: heavy hitters (attention summed over all prompt queries) + the recent window")
preset("tova", "uniform", "tova", "TOVA: the last prompt token's attention (mean over a KV head's query heads)")
preset("knorm", "uniform", "knorm", "KNorm: the smallest key norms + the recent window")
preset("cake", "cake", "snapkv", "CAKE: layer budgets from window attention's entropy and variance, SnapKV scores")
preset("depthkv", "file", "h2o", "DepthKV: budgets proportional to eviction sensitivity (--allocation), H2O scores")
preset("routed", "uniform", "router", "a scorer per layer from a route CSV (--route), uniform budgets")
preset("routed-ripplekv", "file", "router", "a scorer per layer from a route CSV (--route), RippleKV budgets (--allocation)")
preset("gracekv", "gracekv", "gracekv", "GraceKV (our reading): prototype trees of every layer, head and slot "
       "compete for one global budget", GraceKV)
preset("criticalkv", "uniform", "criticalkv", "CriticalKV: SnapKV attention x ||v W_o||_1 in two stages (kvpress CriticalKVPress)")
preset("criticaladakv", "adakv", "criticalkv", "CriticalAdaKV: AdaKV's head split by SnapKV scores, CriticalKV's "
       "two-stage selection (kvpress CriticalAdaKVPress)")
preset("keydiff", "uniform", "keydiff", "KeyDiff: the keys least similar to the mean key direction + the window")
preset("expected-attention", "uniform", "expected-attention", "Expected Attention: attention future queries "
       "are expected to pay (query mean/covariance, averaged RoPE) x ||v|| (kvpress)")
preset("defensivekv", "adakv", "defensivekv", "DefensiveKV: worst-case window attention x normalized "
       "||v W_o||_1, heads compete in each layer (FFY0/DefensiveKV)", alpha=0.0)
preset("layer-defensivekv", "global", "defensivekv", "Layer-DefensiveKV: DefensiveKV's scores, every layer "
       "and head competing for one budget (FFY0/DefensiveKV)")
preset("kvzip", "global", "kvzip", "KVzip: max attention from a context-reconstruction pass (a second "
       "forward), all layers and heads competing (kvpress KVzipPress)")
preset("oracle", "uniform", "oracle", "CEILING, not a method: per head, the entries the full cache's answer "
       "attends to most (eval only; left out of ranks)")


def method_names() -> list[str]:
    return sorted(PRESETS)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name:key=value:key=value` -> (name, {key: value})."""
    name, *parts = [part.strip() for part in str(spec).strip().split(":")]
    if not name:
        raise UserError(f"empty method name in {spec!r}; write e.g. snapkv or snapkv:window=16")
    options: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise UserError(f"method spec {spec!r}: option {part!r} is not key=value (e.g. {name}:window=16)")
        if key in options:
            raise UserError(f"method spec {spec!r} sets {key} twice")
        options[key] = value
    return name, options


def _convert(component: type, key: str, value, spec: str):
    """A string option converted to the field's type (ints, floats, strings, tuples of floats)."""
    if not isinstance(value, str):
        return value
    hint = str(typing.get_type_hints(component).get(key, str))
    try:
        if "tuple" in hint:
            return tuple(float(v) for v in value.split("/"))
        if "float" in hint:
            return float(value)
        if "int" in hint:
            return int(value)
    except ValueError:
        kind = "numbers separated by /" if "tuple" in hint else ("a number" if "float" in hint else "an integer")
        raise UserError(f"method spec {spec!r}: option {key} must be {kind}, got {value!r}") from None
    return value


def _option_names(component: type) -> set[str]:
    return {f.name for f in fields(component) if f.init and not f.metadata.get("internal")}


def _component(kind: str, registry: dict, name: str, spec: str):
    if name not in registry:
        raise UserError(f"method spec {spec!r}: unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


def make_method(spec: str, shared: dict | None = None, **options) -> Method:
    """Build a method from a spec. `options` must each apply (like the spec's own); `shared` options (the
    command line's --window, --allocation, ...) apply to the methods that take them and are ignored by the rest."""
    name, given = parse_spec(spec)
    if name not in PRESETS:
        raise UserError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    chosen = PRESETS[name]
    label = name + "".join(f":{key}={Path(given[key]).name if key in FILE_OPTIONS else given[key]}" for key in sorted(given))
    if chosen.scorer is None:
        if given or options:
            raise UserError(f"method {name!r} takes no options (got {', '.join(sorted({**given, **options}))})")
        return Method(label, name, ALLOCATORS["uniform"](), None)
    allocator_cls = _component("allocator", ALLOCATORS, given.pop("allocator", chosen.allocator), spec)
    scorer_cls = _component("scorer", SCORERS, given.pop("scorer", chosen.scorer), spec)
    allocator_keys, scorer_keys = _option_names(allocator_cls), _option_names(scorer_cls)
    strict = {**options, **given}
    unknown = sorted(set(strict) - allocator_keys - scorer_keys)
    if unknown:
        takes = ", ".join(sorted(allocator_keys | scorer_keys)) or "nothing"
        raise UserError(f"method {label!r}: unknown option(s) {', '.join(unknown)}; it takes: {takes}")
    merged = {k: v for k, v in (shared or {}).items() if v is not None}
    merged.update({k: v for k, v in chosen.options if k in allocator_keys | scorer_keys})
    merged.update(strict)
    allocator_options = {k: _convert(allocator_cls, k, v, spec) for k, v in merged.items() if k in allocator_keys}
    scorer_options = {k: _convert(scorer_cls, k, v, spec) for k, v in merged.items() if k in scorer_keys}
    try:
        allocator, scorer = allocator_cls(**allocator_options), scorer_cls(**scorer_options)
    except UserError as err:
        raise UserError(f"method {label!r}: {err}") from None
    return chosen.kind(label, name, allocator, scorer)


def shared_option_users(specs, shared: dict) -> dict[str, bool]:
    """For each shared option that is set: does any of these methods take it? (An unused flag is a mistake.)"""
    used = {key: False for key, value in shared.items() if value is not None}
    for spec in specs:
        name, given = parse_spec(spec)
        chosen = PRESETS.get(name)
        if chosen is None or chosen.scorer is None:
            continue
        allocator = ALLOCATORS.get(given.get("allocator", chosen.allocator))
        scorer = SCORERS.get(given.get("scorer", chosen.scorer))
        names = (_option_names(allocator) if allocator else set()) | (_option_names(scorer) if scorer else set())
        for key in used:
            used[key] = used[key] or key in names
    return used


def defaults_of(component: type) -> dict:
    """A component's options and their defaults (for `ripplekv methods`)."""
    return {
        f.name: (None if f.default is MISSING else f.default)
        for f in fields(component)
        if f.init and not f.metadata.get("internal") and not f.metadata.get("composition")
    }
