"""Memory planning: the byte budget a sample stays within, what a group of variants costs, and the peak seen.

A sample holds a fixed part (the weights, the one prefill's K/V and what it recorded, the full cache's
reference log-probs, the methods' shared scores) and a part that grows with the variants decoded together.
Only the second is ours to choose: variants are built when their group decodes (`LazyVariants`), groups
are cut by length (`plan_groups`) and each stays under the bytes left beside the fixed part, by the cost
model of `StepCosts`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
from collections.abc import Callable, Sequence

import torch

from ripplekv.errors import Notice, UserError

# Fallback when a caller gives no budget: variants decoded together stay under this many bytes.
DEFAULT_GROUP_BYTES = 2 * 2**30
# The default memory budget: this share of the free device memory (CUDA) or of the available RAM (CPU).
CUDA_SHARE, CPU_SHARE = 0.9, 0.8

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, setting: str = "memory_budget") -> int:
    """'8GiB', '500MB', '1.5 GB' or a plain number of bytes -> bytes (a positive integer); a mistake names
    `setting` (`errors.UserError`)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise UserError(f"{{{setting}}} must be a size with a unit, e.g. 8GiB or 500MB; got {text!r}", setting)
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(count: int, up: bool = False) -> str:
    """GiB to 2 decimals, or MiB to 1; `up`: rounded up, so the size shown is never below `count` (a bound to set)."""
    unit, digits, name = (2**30, 2, "GiB") if count >= 2**30 else (2**20, 1, "MiB")
    shown = count / unit
    if up:
        shown = math.ceil(shown * 10**digits) / 10**digits
    return f"{shown:.{digits}f} {name}"


def _available_ram() -> int:
    """Bytes of RAM the kernel says a new allocation can get (MemAvailable), without psutil."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - neither /proc nor psutil
        return 16 * 2**30


def default_budget(device, held: int) -> int:
    """The memory budget when none is given: `held` (bytes the process's tensors hold now: the weights)
    plus most of what is free (CUDA: the driver's free memory and the caching allocator's unused reserve)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return held + int(CUDA_SHARE * (free + unused))
    return held + int(CPU_SHARE * _available_ram())


def tensor_bytes(*holders) -> int:
    """Bytes of the distinct tensor storages reachable from `holders` (modules, tensors, and lists, dicts and
    dataclasses holding them, a few levels deep: a state's scores hold built entries), each storage once."""
    seen: dict[int, int] = {}

    def visit(item, depth):
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, torch.nn.Module):
            for tensor in [*item.parameters(), *item.buffers()]:
                visit(tensor, depth)
        elif depth < 6 and isinstance(item, (list, tuple)):
            for part in item:
                visit(part, depth + 1)
        elif depth < 6 and isinstance(item, dict):
            for part in item.values():
                visit(part, depth + 1)
        elif depth < 6 and dataclasses.is_dataclass(item) and not isinstance(item, type):
            for part in vars(item).values():
                if not isinstance(part, torch.nn.Module):
                    visit(part, depth + 1)

    for holder in holders:
        visit(holder, 0)
    return sum(seen.values())


def held_bytes(device, *holders) -> int:
    """Bytes held now: on CUDA every allocated tensor; elsewhere the tensors reachable from `holders`."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return tensor_bytes(*holders)


class PeakMemory:
    """The memory of one piece of work (a sample), from `start()` on: its peak, what it holds now, and the
    peak of each stretch between `mark()`s (how much a step took at its height).

    CUDA: tensor bytes (`torch.cuda.memory_allocated`, its peak `max_memory_allocated`; allocator slack not
    counted). CPU: the process's resident set (VmRSS, its high-water mark VmHWM, reset through
    /proc/self/clear_refs), so it includes the interpreter, the libraries and the weights; where that
    cannot be reset, `ru_maxrss`, which counts from the process's start (an over-estimate after a bigger
    sample)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.start()

    def start(self) -> None:
        self.highest = 0
        self._reset()
        self.origin = self.current()

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
        except OSError:
            pass

    def _stretch_peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resident_peak()

    def current(self) -> int:
        """Bytes held now (CUDA: allocated tensors; CPU: the resident set)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return _proc_status("VmRSS") or resident_peak()

    def grown(self) -> int:
        """What the work holds now beyond what was held at its start (never negative)."""
        return max(0, self.current() - self.origin)

    def mark(self) -> int:
        """The peak since the last mark (or the start); a new stretch begins. `peak()` still sees it."""
        seen = self._stretch_peak()
        self.highest = max(self.highest, seen)
        self._reset()
        return seen

    def peak(self) -> int:
        return max(self.highest, self._stretch_peak())


def _proc_status(field: str) -> int:
    """A size field of /proc/self/status in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_peak() -> int:
    """The process's resident-set high-water mark in bytes (VmHWM; ru_maxrss where /proc is missing)."""
    return _proc_status("VmHWM") or int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Bytes a group of variants takes while it decodes, from the model's shapes (`of`).

    A group of k variants padded to P_l entries in layer l, fed F tokens in one forward (the teacher-forced
    answer) and holding up to D decoded tokens, takes: its cache (entries with their float32 bias, decoded
    keys and values twice over, as appending copies them), the forward's activations, and the larger of one
    layer's attention (float32 scores, bias, softmax and their cast: 16 bytes a score) and the log-probs
    (logits, their float32 copy, log-softmax and the KL's temporaries: 16 bytes a logit)."""

    layers: int
    kv_heads: int
    query_heads: int
    head_dim: int
    element: int  # bytes of one key or value number in the model's dtype
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model, state) -> StepCosts:
        config = getattr(model.config, "text_config", None) or model.config
        hidden = int(config.hidden_size)
        return cls(layers=state.num_layers, kv_heads=state.num_kv_heads, query_heads=state.num_query_heads,
                   head_dim=int(state.keys[0].shape[-1]), element=state.keys[0].element_size(), hidden=hidden,
                   intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
                   vocab=int(state.last_logits.shape[-1]))

    @property
    def entry(self) -> int:
        """Bytes of one kept entry in one layer: keys and values of every KV head, and its float32 bias."""
        return self.kv_heads * (2 * self.head_dim * self.element + 4)

    def group(self, size: int, padded: Sequence[int], fed: int, decoded: int) -> int:
        """Bytes of `size` variants padded to `padded[l]` entries, fed `fed` tokens at once, `decoded` held."""
        token = self.kv_heads * 2 * self.head_dim * self.element
        cache = sum(padded) * self.entry + 2 * self.layers * decoded * token
        activations = fed * (6 * self.hidden + 3 * self.intermediate + 3 * self.query_heads * self.head_dim) * self.element
        attention = self.query_heads * fed * (max(padded, default=0) + decoded) * 16
        logits = fed * self.vocab * 16
        return size * (cache + activations + max(attention, logits))

    def building(self, lengths: Sequence[int], prompt: int) -> int:
        """Bytes one variant takes while its method builds it: its entries (positions included) and a
        float32 score, a mask and a sort index for every (layer, head, prompt position)."""
        entries = sum(lengths) * self.kv_heads * (2 * self.head_dim * self.element + 8)
        return entries + self.layers * self.kv_heads * prompt * 16


@dataclasses.dataclass
class LazyVariants:
    """Variants whose entries are built only when their group decodes: `lengths[i]` are variant i's kept
    entries per layer after padding its heads (known from its budgets before anything is built), `build(i)`
    its entries per layer (one `LayerEntries` each)."""

    lengths: list[list[int]]
    build: Callable[[int], list]

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def of(cls, variants) -> LazyVariants:
        """Variants given as built entries (or already lazy), as `LazyVariants`."""
        if isinstance(variants, LazyVariants):
            return variants
        return cls([[layer.capacity for layer in variant] for variant in variants], variants.__getitem__)


@dataclasses.dataclass(frozen=True)
class DecodeCosts:
    """Milliseconds of one decoding step: a fixed part per forward (reading every weight), a part per variant
    (its linear layers), and a part per variant and prompt entry it attends to, summed over layers, padding
    included (memory-bound attention). A device's own come from `engine.decode_costs`."""

    step_ms: float
    variant_ms: float
    entry_ms: float


# Measured on a 2-core CPU with the bundled model at engine v2 (scripts/bench_batch.py): what every CPU plans with
# by default. Today's engine fits other constants there, and planning with them decodes no faster (docs/performance.md).
REFERENCE_COSTS = DecodeCosts(step_ms=100.0, variant_ms=5.0, entry_ms=3.1e-4)


def plan_groups(lengths: list[list[int]], steps: list[int], group_bytes: Callable[[int, list[int]], int],
                memory_bytes: int, most: int | None = None, costs: DecodeCosts = REFERENCE_COSTS) -> list[list[int]]:
    """Split variants into groups decoded together, at the least modelled cost, each within `memory_bytes`.

    One group pays one forward per step but pads every variant to the longest kept layer of any; more
    groups pad less and pay more forwards. Variants are ordered by their total kept length and cut into
    contiguous groups by dynamic programming over the cost model `costs` (a group runs as many steps as its
    longest `steps`). A group of k variants padded to P_l entries in layer l takes `group_bytes(k, P)`,
    which must stay under `memory_bytes` (one variant always makes a group), and has at most `most`.
    """
    order = sorted(range(len(lengths)), key=lambda i: (sum(lengths[i]), i))
    count = len(order)
    best = [0.0] + [float("inf")] * count
    cut = [0] * (count + 1)
    for first in range(count):
        padded = [0] * len(lengths[order[first]])
        longest = variant_steps = 0
        for last in range(first, count):
            row = order[last]
            padded = [max(p, q) for p, q in zip(padded, lengths[row])]
            longest = max(longest, steps[row])
            variant_steps += steps[row]
            size = last - first + 1
            if size > 1 and ((most is not None and size > most) or group_bytes(size, padded) > memory_bytes):
                break
            cost = best[first] + longest * costs.step_ms + variant_steps * (costs.variant_ms + costs.entry_ms * sum(padded))
            if cost < best[last + 1]:
                best[last + 1], cut[last + 1] = cost, first
    groups, end = [], count
    while end:
        groups.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return groups[::-1]


def variant_room(model, state, reference, labels: Sequence[str], lengths: list[list[int]], methods: int,
                 memory_budget: int, prefix: int, max_new_tokens: int) -> int:
    """Bytes left for the variants decoded together: `memory_budget` less what the sample holds (weights,
    prefill, reference, the scores methods shared) and a reserve for building one variant and for the scores
    still to come (one float32 [L, H_kv, n] per method of the `methods`). A UserError names the first variant
    (`labels[i]`, kept entries per layer `lengths[i]`) that cannot decode even alone.

    What the sample holds is counted from its own tensors, never measured on the process (the resident set,
    the allocator's totals): those depend on what ran before in the process (a resumed run starts a fresh
    one), and the groups must not, since a variant's float32 numbers depend on what shares its batch. So a
    sample decodes in the same groups, and gives the same numbers, however it was reached."""
    costs = StepCosts.of(model, state)
    fixed = _fixed_bytes(model, state, reference, lengths, methods)
    fed = max(1, prefix + len(reference.tokens) - 1)
    room = memory_budget - fixed
    alone = [costs.group(1, length, fed, fed + max_new_tokens) for length in lengths]
    largest = max(range(len(alone)), key=alone.__getitem__, default=None)
    if largest is not None and alone[largest] > room:  # the bound named fits every variant of the sample
        raise UserError(f"{labels[largest]} needs {format_bytes(alone[largest])} to decode beside the weights and the "
                        f"prefill ({format_bytes(fixed)}), over {{memory_budget}} {format_bytes(memory_budget)}: raise "
                        f"{{memory_budget}} to at least {format_bytes(fixed + alone[largest], up=True)}, lower "
                        "{budgets} or {max_length}, or drop the method from {methods}",
                        "memory_budget", "budgets", "max_length", "methods")
    return max(room, 1)


def room_left(model, state, reference, lengths: list[list[int]], methods: int, memory_budget: int) -> int:
    """`variant_room` again between groups, from the sample's tensors then (scores a build cached), without its
    check: a group always has at least one variant, and the check ran before the first."""
    return max(memory_budget - _fixed_bytes(model, state, reference, lengths, methods), 1)


def _fixed_bytes(model, state, reference, lengths, methods: int) -> int:
    costs = StepCosts.of(model, state)
    scores = methods * state.num_layers * state.num_kv_heads * state.length * 4
    building = max((costs.building(length, state.length) for length in lengths), default=0)
    return tensor_bytes(model, state, reference) + scores + building


_SAID: set = set()


def note_prefill_over(tokens: int, peak: int, budget: int) -> None:
    """A `Notice` (once per process and budget) when the prefill alone went past the memory budget: the bound
    covers what follows it, so the run goes on, but the sample's peak is not within it."""
    import warnings

    if budget not in _SAID:
        _SAID.add(budget)
        warnings.warn(Notice(f"the prefill of a {tokens}-token prompt peaked at {format_bytes(peak)}, over "
                             f"{{memory_budget}} {format_bytes(budget)} (the bound holds from the variants on): "
                             "raise {memory_budget} or lower {max_length}", "memory_budget", "max_length"),
                      stacklevel=2)
