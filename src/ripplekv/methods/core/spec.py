"""The one parser for method specs, over the named methods of the preset table (`core.presets`).

A spec is a preset name with optional options: `snapkv`, `snapkv:window=16:kernel=5`,
`ripplekv:scorer=random`, `pyramidkv:beta=10`. `allocator=` and `scorer=` swap a component; every other
option sets a field of the allocator or the scorer. An option neither has is a one-line error (never
silently dropped). The spec, with its options sorted, is the method's label in every output; a file
option (`depthkv:allocation=runs/x/depthkv.csv`) shows only its file name there, so a label does not
change when a run's folder moves (the full path is in the config's method_specs).

Compositions use the same grammar: every layer allocator takes `split=adakv` (and `head_alpha=`), so
`ripplekv:split=adakv:scorer=criticalkv` is RippleKV's layer budgets x AdaKV's head split x CriticalKV's
scores. A preset may set its own option defaults (`defensivekv` runs AdaKV's split with alpha=0); a spec's
options override them.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, fields
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.methods.core.base import ALLOCATORS, SCORERS, Method
from ripplekv.methods.core.entry_options import entry_options
from ripplekv.methods.core.presets import PRESETS, Preset, method_names  # noqa: F401 - found here as before
from ripplekv.methods.core.quant_options import PROFILE_FILE, quantized_method, reads_profile
from ripplekv.methods.core.registry import METHOD_CLASSES
from ripplekv.methods.core.thresholded import threshold_option


def file_options() -> set[str]:
    """Options that name a file, as each component declares them (`base.FILE` on its field), and the allocation a
    quantizer's `bits=profile` reads: labels show the file name only."""
    parts = [*ALLOCATORS.values(), *SCORERS.values(), *(own.Options for own in METHOD_CLASSES.values() if hasattr(own, "Options"))]
    return {f.name for part in parts for f in fields(part) if f.metadata.get("file")} | {PROFILE_FILE}


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
    """A string option converted to the field's type (ints, floats, strings, tuples of floats). No option takes
    an infinite or undefined number: inf and nan are refused here, for every method, before any arithmetic."""
    if isinstance(value, str):
        hint = str(typing.get_type_hints(component).get(key, str))
        try:
            if "tuple" in hint:
                value = tuple(float(v) for v in value.split("/"))
            elif "float" in hint:
                value = float(value)
            elif "int" in hint:
                value = int(value)
        except ValueError:
            kind = "numbers separated by /" if "tuple" in hint else ("a number" if "float" in hint else "an integer")
            raise UserError(f"method spec {spec!r}: option {key} must be {kind}, got {value!r}") from None
    numbers = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        raise UserError(f"method spec {spec!r}: option {key} must be a finite number, got {value!r}")
    return value


def _option_names(component: type) -> set[str]:
    return {f.name for f in fields(component) if f.init and not f.metadata.get("internal")}


def _component(kind: str, registry: dict, name: str, spec: str):
    if name not in registry:
        raise UserError(f"method spec {spec!r}: unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


def components(chosen: Preset, given: dict, spec: str) -> dict[str, type]:
    """The classes a spec's options go to: {"allocator": ..., "scorer": ...}, or {"options": ...} for a method
    of its own (which takes no allocator= or scorer=), or {} for the full cache. Pops allocator= and scorer=."""
    if chosen.own is not None:
        swapped = sorted({"allocator", "scorer"} & set(given))
        if swapped:
            raise UserError(f"method {chosen.name!r} is not an allocator x scorer: it takes no {'/'.join(swapped)}= "
                            "(drop it from the spec)")
        return {"options": chosen.own.Options}
    if chosen.is_full:
        return {}
    return {"allocator": _component("allocator", ALLOCATORS, given.pop("allocator", chosen.allocator), spec),
            "scorer": _component("scorer", SCORERS, given.pop("scorer", chosen.scorer), spec)}


def make_method(spec: str, shared: dict | None = None, **options) -> Method:
    """Build a method from a spec. `options` must each apply (like the spec's own); `shared` options (the
    command line's --window, --allocation, ...) apply to the methods that take them and are ignored by the rest."""
    name, given = parse_spec(spec)
    if name not in PRESETS:
        raise UserError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    quantized = _with_quantizer(name, given, spec, shared, options)
    if quantized is not None:
        return quantized
    rewritten = entry_options(name, given, spec, lambda inner: make_method(inner, shared, **options))
    if rewritten is not None:
        return rewritten
    thresholded = threshold_option(name, given, spec, lambda inner: make_method(inner, shared, **options))
    if thresholded is not None:
        return thresholded
    chosen = PRESETS[name]
    raw = dict(given)
    files = file_options()
    label = name + "".join(f":{key}={Path(given[key]).name if key in files else given[key]}" for key in sorted(given))
    if chosen.is_full:
        if given or options:
            raise UserError(f"method {name!r} takes no options (got {', '.join(sorted({**given, **options}))})")
        return chosen.kind(label, name, ALLOCATORS["uniform"](), None)
    classes = components(chosen, given, spec)
    keys = {part: _option_names(cls) for part, cls in classes.items()}
    takes = set().union(*keys.values())
    strict = {**options, **given}
    unknown = sorted(set(strict) - takes)
    if unknown:
        raise UserError(f"method {label!r}: unknown option(s) {', '.join(unknown)}; it takes: {', '.join(sorted(takes)) or 'nothing'}")
    merged = {k: v for k, v in (shared or {}).items() if v is not None}
    merged.update({k: v for k, v in chosen.options if k in takes})
    merged.update(strict)
    converted = {part: {k: _convert(cls, k, v, spec) for k, v in merged.items() if k in keys[part]}
                 for part, cls in classes.items()}
    label = canonical_label(name, raw, {k: v for options in converted.values() for k, v in options.items()})
    try:
        built = {part: cls(**converted[part]) for part, cls in classes.items()}
    except UserError as err:
        raise UserError(f"method {label!r}: " + str(err.args[0] if err.args else ""), *err.args[1:]) from None
    check_used(label, built, keys, set(strict) | ({"allocator", "scorer"} & set(raw)))
    if chosen.own is not None:
        return chosen.own(label, name, built["options"])
    return chosen.kind(label, name, built["allocator"], built["scorer"])


def _with_quantizer(name: str, given: dict, spec: str, shared, options):
    """A spec with a quantizer (`kivi`, `METHOD:quant=kivi:bits=4`): the method without it, wrapped
    (`methods.core.quant_options`); None for every other spec."""
    return quantized_method(name, given, spec, shared, lambda inner: make_method(inner, shared, **options),
                            lambda inner: "allocation" in options_taken([inner]))


def unused_options(built: dict) -> dict[str, str]:
    """The options of a method's parts (`built`: {"allocator": ..., "scorer": ...} or {"options": ...}) that change
    nothing with the others as set, name -> why: those each part says it leaves unused (an option two parts
    take is unused only when both leave it), and a head split by scores that are the same in every head."""
    said: dict[str, list[str]] = {}
    takers: dict[str, int] = {}
    for part in built.values():
        for key in _option_names(type(part)):
            takers[key] = takers.get(key, 0) + 1
        for key, why in part.unused_options().items():
            said.setdefault(key, []).append(why)
    unused = {key: whys[0] for key, whys in said.items() if len(whys) == takers.get(key, 0)}
    allocator, scorer = built.get("allocator"), built.get("scorer")
    if allocator is not None and scorer is not None and allocator.splits_by_scores and scorer.same_for_every_head:
        why = (f"scorer {scorer.name}'s scores are the same in every KV head, so a head split by them is the even "
               "split")
        for key in ("split", "head_alpha"):
            unused.setdefault(key, why)
    return unused


def check_used(label: str, built: dict, keys: dict, given: set) -> None:
    """The one check every method family's options pass: an option the spec (or a caller) sets that changes
    nothing, given the others, is refused in one line naming what the method does take; otherwise two specs
    that compute the same thing would be ranked as rivals."""
    allocator, scorer = built.get("allocator"), built.get("scorer")
    if (allocator is not None and scorer is not None and allocator.same_budget_every_layer
            and allocator.splits_by_scores and scorer.same_for_every_head and {"allocator", "scorer"} & given
            and "split" not in given):
        raise UserError(f"method {label!r}: allocator {allocator.name} only splits each layer's budget over its heads "
                        f"by the scorer's scores, and scorer {scorer.name}'s are the same in every KV head, so this is "
                        f"{scorer.name}'s selection at uniform budgets: use the method that names it (e.g. "
                        f"snapkv:scorer={scorer.name}) once")
    unused = unused_options(built)
    idle = sorted(key for key in given if key in unused)
    if idle:
        takes = sorted(set().union(*keys.values()) - set(unused))
        raise UserError(f"method {label!r}: option {', '.join(idle)} changes nothing here ({unused[idle[0]]}); "
                        f"drop it; with these settings it takes: {', '.join(takes) or 'nothing'}")


def reads_allocation(described: dict) -> bool:
    """Does a method read an allocation file, by its `describe()` (as config.json records it): its allocator's
    multipliers or a quantizer's per-layer bits (bits=profile)?"""
    return any("allocation" in described.get(part, {}) for part in ("allocator", "quantizer"))


def options_taken(specs) -> set[str]:
    """Every option some of these methods take (as their components declare them); unknown names add none."""
    taken: set[str] = set()
    for spec in specs:
        name, given = parse_spec(spec)
        chosen = PRESETS.get(name)
        if chosen is None:
            continue
        if reads_profile(given):  # bits=profile reads the allocation's sensitivity (`methods.core.bit_allocation`)
            taken.add("allocation")
        try:
            classes = components(chosen, dict(given), spec)
        except UserError:
            continue
        for cls in classes.values():
            taken |= _option_names(cls)
    return taken


def _canonical(value) -> str:
    """One spelling per value: 016 and 16 are 16, 10.0 and 1e1 are 10, 0.50 is 0.5."""
    if isinstance(value, tuple):
        return "/".join(_canonical(v) for v in value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


def canonical_label(name: str, given: dict[str, str], converted: dict) -> str:
    """The label of a spec from its parsed values, so that two spellings of one method are one label
    (and so refused as a duplicate); files show their name only, components their name."""
    files = file_options()

    def text(key: str) -> str:
        if key in files:
            return Path(given[key]).name
        return _canonical(converted[key]) if key in converted else given[key].strip()

    return name + "".join(f":{key}={text(key)}" for key in sorted(given))


def check_distinct(methods, setting: str = "methods") -> None:
    """Two entries that are one method (one label, or the same resolved options, as `snapkv` and
    `snapkv:window=32`) are refused: they would be computed twice and ranked as rivals."""
    import json

    by_label: dict[str, str] = {}
    by_options: dict[str, str] = {}
    for method in methods:
        resolved = json.dumps(method.describe(), sort_keys=True, default=str)
        same = by_label.get(method.label) or by_options.get(resolved)
        if same is not None:
            raise UserError(f"{{{setting}}} names one method twice ({same} and {method.label}); name each once", setting)
        by_label[method.label] = by_options[resolved] = method.label


def identity(method) -> str:
    """What a method computes, whatever it is called: its resolved description without the preset name, each
    component in its canonical form (`Allocator.canonical`), so aliases (`uniform` and `snapkv`, `adakv` and
    `snapkv:split=adakv`) have one identity."""
    import json

    described = {key: value for key, value in method.describe().items() if key != "preset"}
    allocator = getattr(method, "allocator", None)
    if allocator is not None and "allocator" in described:
        described["allocator"] = allocator.canonical()
    return json.dumps(described, sort_keys=True, default=str)


def collapse_aliases(methods: list) -> tuple[list, list[str]]:
    """The methods with each alias computed once (the first name given stands for the others), and one
    `note:` line per name dropped, so a leaderboard never ranks a method against itself under another name."""
    first: dict[str, object] = {}
    kept, notes = [], []
    for method in methods:
        same = first.setdefault(identity(method), method)
        if same is method:
            kept.append(method)
        else:
            notes.append(f"note: {method.label} is another name for {same.label} (the same method); "
                         f"computed once, as {same.label}")
    return kept, notes


def degenerate_notes(methods, budgets) -> list[str]:
    """One `note:` line per method whose options leave it no choice at a budget (README, "Method
    options"): it still runs, and its numbers are those of what it turns into, so the user is told;
    and one per answer-aware variant (a part of it knows the answer), which reports leave out of ranks."""
    notes = []
    for method in methods:
        whys = {b: method.degenerate(b) for b in budgets}
        hit = [b for b, why in whys.items() if why]
        if hit:
            notes.append(f"note: {method.label} at B={','.join(map(str, hit))}: {whys[hit[-1]]}")
        if getattr(method, "knows_answer", False):
            notes.append(f"note: {method.label} reads the full cache's answer: answer-aware, not a method, reported "
                         "beside the methods and left out of ranks")
    return notes


def shared_option_users(specs, shared: dict) -> dict[str, bool]:
    """For each shared option that is set: does any of these methods take it? (An unused flag is a mistake.)"""
    taken = options_taken(specs)
    return {key: key in taken for key, value in shared.items() if value is not None}


def component_names(chosen: Preset) -> tuple[str, str]:
    """(allocator, scorer) of a preset as `ripplekv methods` shows them."""
    if chosen.own is not None:
        return "(own)", "(own)"
    return chosen.allocator or "-", chosen.scorer or "-"


def defaults_of(component: type) -> dict:
    """A component's options and their defaults (for `ripplekv methods`)."""
    return {
        f.name: (None if f.default is MISSING else f.default)
        for f in fields(component)
        if f.init and not f.metadata.get("internal") and not f.metadata.get("composition")
    }
