"""LU-KV: per-layer and per-head budgets read from an offline curve (arXiv 2602.08585; kvpress `LUKVPress`).

A curve holds, for every global prune ratio rho_i = i / 100 (i = 1..99), each (layer, KV head)'s prune ratio,
profiled offline on calibration prompts (`pipeline.head_curves`, `ripplekv fit lukv`; the solver is
`methods.lukv.greedy`). At a prompt of n tokens and budget B, rho = 1 - B / n; each head's keep share is
the curve at rho (linear between rows; 0 pruned at rho = 0), and the shares become integer counts that sum
exactly to L x H_kv x B (`budgets.integer_budgets` over all heads at once), each at least the scorer's
protected entries. The scorer picks the entries: `lukv` is Expected Attention as LU-KV and kvpress run it
(epsilon 0.02, 4 sinks, a window of 1); `lukv:scorer=snapkv` sets LU-KV's head budgets with SnapKV's scores
(the allocation-only table's scorer). A curve fits only the scorer it was profiled with: its provenance
(the `.json` beside the CSV) names it, and another scorer is refused.

With `split=even` or `split=adakv` LU-KV keeps only its *layer* totals (the curve's keep shares summed over a
layer's heads, rounded to L x B exactly) and hands them to that head split, as any layer allocator would: the
study's factorial core separates LU-KV's allocation across layers from its split across heads this way.

kvpress rounds differently (`rounding=kvpress`, for make check-references): it reads the curve's row
round(100 rho) - 1, gives each head floor((1 - r) n) and, per layer, the leftover of round(sum) to the heads
with the largest fractions, at least 1 each, so its totals drift from L x H_kv x B by the distance from
rho to the nearest percent (up to n / 200 entries per head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import ripplekv
from ripplekv.errors import UserError
from ripplekv.methods.core import fitted_weights
from ripplekv.methods.core.base import FILE, Allocator, AllocatorScorer, options_of, register_allocator
from ripplekv.methods.core.budgets import check_budget, integer_budgets
from ripplekv.methods.core.registry import register_method_class
from ripplekv.methods.lukv.greedy import RATIOS

COLUMNS = ["ratio", "layer", "head", "prune"]
SHIPPED = Path(ripplekv.__file__).resolve().parent / "data" / "lukv"  # the package's data, wherever this module sits
ROUNDINGS = ("exact", "kvpress")
PROFILE_HINT = ("profile one on calibration prompts: ripplekv fit lukv --methods SPEC "
                "--out DIR, then pass SPEC:curve=DIR/curve-SCORER.csv")


def shipped_curve(scorer_name: str) -> Path:
    """The bundled model's budget curve for a scorer (there is one per scorer LU-KV ships a curve for)."""
    from ripplekv.engine.models import DEFAULT_MODEL

    return SHIPPED / f"{DEFAULT_MODEL}-{scorer_name}.csv"


def protected(scorer) -> tuple[int, int]:
    """(sink, window): the first and last entries the scorer always keeps (its `n_sink`, its `window`)."""
    return int(getattr(scorer, "n_sink", 0) or 0), int(getattr(scorer, "window", 0) or 0)


def scorer_identity(scorer) -> dict:
    """What a curve's provenance records of its scorer (name and every option)."""
    return json.loads(json.dumps({"name": scorer.name, **options_of(scorer)}))


def read_curve(path: str | Path) -> tuple[np.ndarray, dict]:
    """(curve [99, L, H], provenance or {}) from a curve CSV; every problem is one line naming the file."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise UserError(f"LU-KV curve {path} does not exist; {PROFILE_HINT}")
    try:
        frame = pd.read_csv(path)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as err:
        raise UserError(f"LU-KV curve {path} is not a readable CSV ({str(err).splitlines()[0]})") from None
    if list(frame.columns) != COLUMNS:
        raise UserError(f"LU-KV curve {path} has columns {','.join(map(str, frame.columns))}; expected {','.join(COLUMNS)}")
    ids = frame[["layer", "head"]]
    if ids.isna().any().any() or not all(pd.api.types.is_integer_dtype(ids[c]) for c in ids) or (ids < 0).any().any():
        raise UserError(f"LU-KV curve {path}: layer and head must be whole numbers from 0")
    ratios = np.round(frame["ratio"].to_numpy(dtype=float), 6)
    prune = frame["prune"].to_numpy(dtype=float)
    if not np.isfinite(prune).all() or (prune < 0).any() or (prune > 1).any():
        raise UserError(f"LU-KV curve {path}: prune ratios must lie in [0, 1]")
    layers, heads = int(ids["layer"].max()) + 1, int(ids["head"].max()) + 1
    expected = len(RATIOS) * layers * heads
    keys = set(zip(ratios.tolist(), ids["layer"].tolist(), ids["head"].tolist()))
    if len(frame) != expected or len(keys) != expected or not set(ratios.tolist()) <= set(np.round(RATIOS, 6).tolist()):
        raise UserError(f"LU-KV curve {path} must hold one row per ratio 0.01..0.99, layer and head "
                        f"({expected} rows for {layers} layers x {heads} heads), got {len(frame)}")
    order = np.lexsort((ids["head"].to_numpy(), ids["layer"].to_numpy(), ratios))
    curve = prune[order].reshape(len(RATIOS), layers, heads)
    sidecar = path.with_suffix(".json")
    provenance = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    return curve, provenance


def check_scorer(path, provenance: dict, scorer) -> None:
    """A curve fits only the scorer it was profiled with (when its provenance names one)."""
    recorded = provenance.get("scorer")
    if recorded is not None and recorded != scorer_identity(scorer):
        raise UserError(f"LU-KV curve {path} was profiled with scorer {recorded}, this method scores with "
                        f"{scorer_identity(scorer)}; a curve fits only its scorer: {PROFILE_HINT}")


def keep_shares(curve: np.ndarray, rho: float) -> np.ndarray:
    """Each head's keep share [L, H] at global prune ratio `rho` (linear between the curve's rows)."""
    grid = np.concatenate([[0.0], RATIOS])
    table = np.concatenate([np.zeros((1,) + curve.shape[1:]), curve])
    rho = min(max(rho, 0.0), float(RATIOS[-1]))
    upper = int(np.searchsorted(grid, rho))
    if upper == 0:
        return 1 - table[0]
    share = (rho - grid[upper - 1]) / (grid[upper] - grid[upper - 1])
    return 1 - ((1 - share) * table[upper - 1] + share * table[upper])


def exact_counts(curve: np.ndarray, budget: int, length: int, floor: int) -> np.ndarray:
    """[L, H] counts in proportion to the curve's keep shares at rho = 1 - B / n, summing to L x H x B."""
    layers, heads = curve.shape[1:]
    if length <= budget:
        return np.full((layers, heads), length, dtype=np.int64)
    shares = keep_shares(curve, 1 - budget / length)
    counts = integer_budgets(shares.reshape(-1).tolist(), budget, length, floor)
    return np.asarray(counts, dtype=np.int64).reshape(layers, heads)


def kvpress_counts(curve: np.ndarray, budget: int, length: int) -> np.ndarray:
    """[L, H] counts as kvpress's LUKVPress rounds them at compression ratio 1 - B / n (read, not copied)."""
    layers, heads = curve.shape[1:]
    rho = 1 - budget / length
    if rho <= 0:
        return np.full((layers, heads), length, dtype=np.int64)
    row = min(max(int(round(rho * 100)) - 1, 0), len(RATIOS) - 1)
    counts = np.zeros((layers, heads), dtype=np.int64)
    for layer in range(layers):
        ideal = np.clip(1 - curve[row, layer].astype(np.float32), 0, 1) * np.float32(length)
        target = min(max(int(np.round(ideal.sum())), heads), heads * length)
        base = np.floor(ideal).astype(np.int64)
        left = target - int(base.sum())
        if left > 0:  # the largest fractions first, ties to the lower head
            base[np.argsort(-(ideal - base), kind="stable")[: min(left, heads)]] += 1
        counts[layer] = np.clip(base, 1, length)
    return counts


@register_method_class("lukv")
@dataclass(frozen=True)
class CurveMethod(AllocatorScorer):
    """The `lukv` preset: its curve's scorer is checked against the method's when the method is built, before any
    model work (a curve of another scorer is one line)."""

    def __post_init__(self):
        if isinstance(self.allocator, LUKV) and self.allocator.curve is not None and self.scorer is not None:
            check_scorer(self.allocator.curve, read_curve(self.allocator.curve)[1], self.scorer)


@register_allocator("lukv")
@dataclass(frozen=True)
class LUKV(Allocator):
    curve: str | None = field(default=None, metadata=FILE)
    rounding: str = "exact"
    prompt_dependent = True
    prompt_note = "its per-head budgets follow its curve at each prompt's length; `ripplekv eval` records them per sample"

    def __post_init__(self):
        self.check_heads()
        if self.rounding not in ROUNDINGS:
            raise UserError(f"option rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.curve is not None:
            read_curve(self.curve)  # a bad file is one line before any model work

    def takes_split(self) -> bool:
        """Its curve sets per-head counts; `split=` asks for its layer totals under that head split instead."""
        return True

    def check_heads(self) -> None:
        super().check_heads()
        if self.split is not None and self.rounding == "kvpress":
            raise UserError("lukv's rounding=kvpress reproduces kvpress's per-head counts; it takes no split=")

    def layer_budgets(self, num_layers, budget, length, floor):
        raise UserError(f"lukv's budgets differ by head; {self.prompt_note}")

    def prompt_budgets(self, state, budget, scorer) -> list[int]:
        """Per-layer totals (with `split=`): the curve's keep shares at this prompt summed over each layer's heads."""
        if state.length <= budget:
            return [state.length] * state.num_layers
        shares = keep_shares(self.curve_for(state, scorer), 1 - budget / state.length).sum(axis=1)
        floor = min(max(sum(protected(scorer)), scorer.floor(), 1), budget)
        return integer_budgets(shares.tolist(), budget, state.length, floor)

    def curve_path(self, bundled: bool, scorer) -> str | Path:
        """The curve given, or the one shipped for the bundled model and this scorer (none: refused)."""
        if self.curve is not None:
            return self.curve
        shipped = shipped_curve(scorer.name)
        if not (bundled and shipped.is_file()):
            raise UserError(f"lukv needs a budget curve for this model and scorer ({scorer.name}); {PROFILE_HINT}")
        return shipped

    def curve_for(self, state, scorer, bundled: bool | None = None) -> np.ndarray:
        """The curve (given, or shipped for the bundled model and this scorer), checked against both."""
        if bundled is None:
            from ripplekv.engine.models import is_bundled

            bundled = state.model is not None and is_bundled(state.model)
        path = self.curve_path(bundled, scorer)
        curve, provenance = read_curve(path)
        fitted_weights.check_shape("LU-KV curve", path, curve.shape[1:], (state.num_layers, state.num_kv_heads),
                                   PROFILE_HINT)
        check_scorer(path, provenance, scorer)
        return curve

    def check_fitted(self, shape, bundled: bool, scorer) -> None:
        """Before any prefill: the curve exists and fits the model (`shape`: its layers, KV heads, hidden size)
        and the scorer; a prompt no longer than the budget never reads it, so only this check would say."""
        self.curve_for(SimpleNamespace(num_layers=shape[0], num_kv_heads=shape[1]), scorer, bundled)

    def allocate(self, state, budget, scorer):
        check_budget(budget)
        if self.split is not None:
            return super().allocate(state, budget, scorer)
        curve = self.curve_for(state, scorer)
        if self.rounding == "kvpress":
            return kvpress_counts(curve, budget, state.length)
        floor = min(max(sum(protected(scorer)), scorer.floor(), 1), budget)
        return exact_counts(curve, budget, state.length, floor)
