"""Key-channel pruning (ThinK, Xu et al. 2024, arXiv 2407.21018; kvpress `ThinKPress`): a third way to spend budget B's
bytes, beside fewer entries and fewer bits.

Each (layer, KV head) stores only some channels of its kept keys; values keep every channel. A channel's
importance is ThinK's: the mean square of the observation window's queries in that channel (averaged over the
query heads that share the KV head) times the mean square of the kept keys in it; the `int(d x ratio)` least
important are pruned, and attention reads them as zero (a query's product with a pruned key is its product over
the kept channels). The kept keys are those the method's entry selection keeps, as kvpress's composition
(`ComposedPress([SnapKVPress, ThinKPress])`) scores them; the channels are chosen before any quantization.

It composes like a quantizer: `snapkv:think=0.5` keeps SnapKV's selection at the entry budget B' whose entries,
with half their key channels, fit in B's bytes (`methods.core.quantized`), and `snapkv:think=0.5:quant=kivi:bits=4`
stores those keys and values at 4 bits besides. The bytes count the stored channels and each head's channel
mask (`engine.quantize.head_bytes`); kvpress zeroes the channels and keeps the keys' full size (no saving), so the
reference check compares the channels chosen, not bytes. `think` alone is the full cache with pruned keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ripplekv.engine import entries as kv_entries
from ripplekv.engine.prefill import PrefillState, Requirements
from ripplekv.errors import UserError

OPTIONS = ("think", "think_window")  # on any method: METHOD:think=RATIO[:think_window=W]
PRESET_OPTIONS = ("ratio", "window")  # on the `think` preset itself (the full cache with pruned keys)
DEFAULT_RATIO = 0.5
DEFAULT_WINDOW = 32  # ThinK's and kvpress's observation window
THINK_HELP = (f"key channels (think, or METHOD:think=RATIO): prune the fraction RATIO of each head's key channels "
              f"(ThinK: window queries' energy x kept keys' energy per channel; think_window={DEFAULT_WINDOW}); "
              "the bytes freed buy more entries at the same budget; composes with quant=kivi")


@dataclass(frozen=True)
class KeyChannels:
    """Prune the fraction `ratio` of every head's key channels, ranked by ThinK's score over `window` queries."""

    ratio: float = DEFAULT_RATIO
    window: int = DEFAULT_WINDOW

    def pruned(self, head_dim: int) -> int:
        return int(head_dim * self.ratio)

    def kept(self, head_dim: int) -> int:
        return head_dim - self.pruned(head_dim)

    def describe(self) -> dict:
        return {"ratio": self.ratio, "window": self.window}

    def label(self, preset: bool) -> str:
        """The spec's own spelling: `:ratio=..` on the `think` preset, `:think=..` on any other method."""
        ratio, window = PRESET_OPTIONS if preset else OPTIONS
        shown = not preset or self.ratio != DEFAULT_RATIO
        return ((f":{ratio}={_number(self.ratio)}" if shown else "")
                + (f":{window}={self.window}" if self.window != DEFAULT_WINDOW else ""))

    def requirements(self) -> Requirements:
        return Requirements(capture_window=self.window)

    def channel_scores(self, state: PrefillState, layer: int, built: kv_entries.LayerEntries) -> torch.Tensor:
        """[H_kv, d] float32: ThinK's importance of each key channel in each KV head."""
        window = min(self.window, state.length)
        queries = state.window_queries(layer, window, "think").float()  # [H_q, w, d]
        heads = built.num_heads
        query_energy = queries.pow(2).mean(1).view(heads, -1, queries.shape[-1]).mean(1)  # [H_kv, d]
        real = torch.arange(built.capacity, device=built.keys.device)[None, :] < built.counts[:, None]
        squares = built.keys.float().pow(2) * real[..., None]
        key_energy = squares.sum(1) / built.counts.clamp(min=1)[:, None].float()
        return query_energy * key_energy

    def choose(self, state: PrefillState, layer: int, built: kv_entries.LayerEntries) -> torch.Tensor:
        """[H_kv, kept] long: the channels each head keeps, ascending; ties go to the lower channel."""
        scores = self.channel_scores(state, layer, built)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        return order[:, : self.kept(scores.shape[-1])].sort(-1).values


def parse(given: dict, spec: str, preset: bool) -> KeyChannels | None:
    """The key-channel options a spec sets (popped from `given`), checked; None when it sets none (and is not the
    `think` preset, which prunes by default)."""
    names = PRESET_OPTIONS if preset else OPTIONS
    own = {key: given.pop(key) for key in names if key in given}
    if not own and not preset:
        return None
    if not preset and names[0] not in own:
        raise UserError(f"method spec {spec!r}: think_window needs think=RATIO (the fraction of key channels pruned)")
    ratio = _read(own.get(names[0], str(DEFAULT_RATIO)), names[0], spec, float)
    window = _read(own.get(names[1], str(DEFAULT_WINDOW)), names[1], spec, int)
    if not 0 < ratio < 1:
        raise UserError(f"method spec {spec!r}: option {names[0]} is the fraction of key channels pruned, strictly "
                        f"between 0 and 1, got {ratio!r}")
    if window < 1:
        raise UserError(f"method spec {spec!r}: option {names[1]} must be a positive integer, got {window!r}")
    return KeyChannels(ratio, window)


def _read(text: str, key: str, spec: str, kind):
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UserError(f"method spec {spec!r}: option {key} must be {what}, got {text!r}") from None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
