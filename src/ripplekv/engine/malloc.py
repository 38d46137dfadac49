"""What glibc's malloc does with freed blocks, so that the resident set the CPU memory bound reads is honest.

By default glibc keeps freed blocks resident for reuse, and the threshold above which it maps blocks apart grows
with the blocks freed: a decoding group's tensors, freed, would stay resident for the next, and the resident set
would grow past the tensors held. `return_freed_memory` has it hand blocks over `RETURN_FREED_ABOVE` back at
once. A long forward, though, frees and asks for the same tens of MiB layer after layer; mapped afresh each time
they cost about 1 s per 3.5k-token prefill of the bundled model (8.7 s and 855k page faults, against 7.6 s and
87k faults kept). `keeping_freed_memory` keeps them for such a forward, unless the user set the budget.
"""

from __future__ import annotations

import contextlib

# Above this size malloc maps each block apart and unmaps it when freed (`return_freed_memory`).
RETURN_FREED_ABOVE = 16 * 2**20
# Within `keeping_freed_memory`: blocks up to this size come from (and go back to) malloc's heap, whose free top is
# handed back once it passes the second. Larger blocks are still mapped apart, so little is held beyond them.
KEEP_FREED_UP_TO, KEEP_FREE_TOP = 32 * 2**20, 128 * 2**20


def return_freed_memory() -> bool:
    """On glibc, have malloc hand blocks over `RETURN_FREED_ABOVE` back to the system as soon as they are freed
    (mallopt: a fixed mmap threshold, trimming at once), once per process. True when it took."""
    global _RETURNING
    if _RETURNING is None:
        _RETURNING = _set_thresholds(RETURN_FREED_ABOVE)
    return _RETURNING


def allow_keeping(allowed: bool) -> None:
    """Whether `keeping_freed_memory` may keep freed blocks: not for a sample under a budget the user set, whose
    peak must hold only what is alive (its prefill can sit at the bound), yes under the default one."""
    global _KEEPING_ALLOWED
    _KEEPING_ALLOWED = allowed


@contextlib.contextmanager
def keeping_freed_memory():
    """Within the block malloc keeps freed blocks up to `KEEP_FREED_UP_TO` for reuse; after it the thresholds are
    restored and what the block left free is handed back (malloc_trim). The heap it grew keeps its holes, though:
    later blocks that fit one reuse it and stay resident when freed, until a trim. A no-op unless
    `return_freed_memory` took and `allow_keeping` allows it (so never under a budget the user set)."""
    if not (_RETURNING and _KEEPING_ALLOWED):
        yield
        return
    _set_thresholds(KEEP_FREED_UP_TO, KEEP_FREE_TOP)
    try:
        yield
    finally:
        _set_thresholds(RETURN_FREED_ABOVE)
        _LIBC.malloc_trim(0)


def _set_thresholds(size: int, trim: int | None = None) -> bool:
    """glibc's mmap threshold `size` bytes and trim threshold `trim` (default the same); False if not glibc."""
    global _LIBC
    try:
        import ctypes

        _LIBC = _LIBC or ctypes.CDLL(None)
        mallopt, _ = _LIBC.mallopt, _LIBC.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, size)) and bool(mallopt(_M_TRIM_THRESHOLD, trim or size))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LIBC = None
_RETURNING: bool | None = None
_KEEPING_ALLOWED = True
