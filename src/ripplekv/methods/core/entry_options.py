"""The spec options `merge=` and `rerotate=` (`methods.core.wrapped`): the method without them, wrapped."""

from __future__ import annotations

from collections.abc import Callable

from ripplekv.errors import UserError
from ripplekv.methods.core.merging import Merged
from ripplekv.methods.core.rerotation import Rerotated
from ripplekv.methods.core.wrapped import MERGE_RULES, OPTIONS


def entry_options(name: str, given: dict, spec: str, build: Callable[[str], object]):
    """A spec with `merge=` or `rerotate=` (popped from `given`): the method without them, wrapped; None when the
    spec sets neither."""
    own = {key: given.pop(key) for key in OPTIONS if key in given}
    if not own:
        return None
    rule = own.get("merge")
    if rule is not None and rule not in MERGE_RULES:
        raise UserError(f"method spec {spec!r}: merge must be one of {', '.join(MERGE_RULES)}, got {rule!r}")
    if "rerotate" in own and own["rerotate"] not in ("1", "0"):
        raise UserError(f"method spec {spec!r}: rerotate=1 re-rotates the kept keys (0, the default, leaves them); "
                        f"got {own['rerotate']!r}")
    if own.get("rerotate") == "0":
        raise UserError(f"method spec {spec!r}: rerotate=0 is the method itself; drop the option")
    method = build(":".join([name, *(f"{k}={v}" for k, v in given.items())]))
    if method.is_full:
        raise UserError(f"method spec {spec!r}: {'/'.join(own)}= rewrites what an evicting method keeps; {name} "
                        "evicts nothing (use it on one that does, e.g. snapkv:merge=kvpress)")
    if getattr(method, "scorer", None) is None:
        raise UserError(f"method spec {spec!r}: {name} builds its own entries (prototypes), not a selection of prompt "
                        f"tokens; {'/'.join(own)}= applies to the methods that keep tokens")
    if rule is not None:
        method = Merged(f"{method.label}:merge={rule}", method, rule)
    if "rerotate" in own:
        method = Rerotated(f"{method.label}:rerotate=1", method)
    return method
