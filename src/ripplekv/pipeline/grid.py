"""A grid search on calibration prompts whose pick is never left at the grid's edge unsaid.

A knob chosen on a grid (RippleKV's ratio, CAKE's temperatures, PyramidKV's beta) is only chosen if the grid
brackets the pick: when the lowest KL sits at the largest (or smallest) value of an axis, the true best may lie
beyond it. So the search steps out, doubling (halving) that axis's extreme, scores only the new points, and
looks again, at most `max_extensions` times per axis. It stops at the knob's own bound (a ratio of 1 is uniform,
nothing lies below it): a pick there is at the edge of what the knob means, not of the grid, and is said so.
A pick still at an extended edge after the last extension is noted as such, never passed off as bracketed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

FACTOR = 2.0  # each extension doubles the largest value (or halves the smallest) of an axis


@dataclass(frozen=True)
class Axis:
    """One knob: its name, its starting values, and its domain's bounds (inclusive; None: unbounded)."""

    name: str
    values: tuple[float, ...]
    low: float | None = None
    high: float | None = None
    valid: Callable[[float], bool] | None = None  # whether the knob takes a value (a method's own check)

    def outward(self, values: list[float], pick: float) -> tuple[float | None, str | None]:
        """(the next value beyond the pick when it is at an edge of `values`, else None; a note when the pick is at
        an edge that cannot be passed)."""
        if len(values) < 2:
            return None, None
        if pick == max(values):
            if self.high is not None and pick >= self.high:
                return None, f"{self.name} {pick:g} is its largest meaningful value"
            nxt = pick * FACTOR if self.high is None else min(pick * FACTOR, self.high)
            return self._checked(nxt, pick)
        if pick == min(values):
            if self.low is not None and pick <= self.low:
                return None, f"{self.name} {pick:g} is its smallest meaningful value"
            nxt = pick / FACTOR if self.low is None else max(pick / FACTOR, self.low)
            return self._checked(nxt, pick)
        return None, None

    def _checked(self, nxt: float, pick: float) -> tuple[float | None, str | None]:
        if self.valid is not None and not self.valid(nxt):
            return None, f"{self.name} {pick:g} is at the edge of the values it takes ({nxt:g} is refused)"
        return nxt, None


@dataclass
class GridResult:
    """Every point scored (`table`: one column per axis, then the scores), the pick, and what was extended."""

    table: pd.DataFrame
    pick: dict[str, float]
    axes: dict[str, list[float]]  # the final values of each axis
    extensions: dict[str, int]
    notes: list[str]
    bounded: frozenset[str] = frozenset()  # axes whose pick sits at the knob's own bound (nothing lies beyond it)

    @property
    def at_edge(self) -> bool:
        """Whether the pick is still at an open edge of some axis's grid (the extensions ran out before it)."""
        return any(len(v) > 1 and self.pick[name] in (min(v), max(v)) and name not in self.bounded
                   for name, v in self.axes.items())


def _points(axes: dict[str, list[float]]) -> list[tuple[float, ...]]:
    return list(itertools.product(*axes.values()))


class GridSearch:
    """A grid search in rounds: `pending` holds the points still to score; `add(scores)` takes their scores (one
    row per point, the axes' columns and `objective`, lower is better) and sets the next round's points, if the pick
    is at an edge that may be passed. Several searches can be scored together, one round at a time (`tune` scores
    every method's points from one prefill per prompt). Ties go to the point with the smallest values, so the pick
    is a function of the scores alone."""

    def __init__(self, axes: list[Axis], max_extensions: int = 3, objective: str = "kl"):
        if max_extensions < 0:
            raise ValueError(f"max_extensions must be 0 or more, got {max_extensions}")
        self.axes, self.max_extensions, self.objective = axes, max_extensions, objective
        self.values = {axis.name: sorted({float(v) for v in axis.values}) for axis in axes}
        self.extensions = {axis.name: 0 for axis in axes}
        self.scored = pd.DataFrame()
        self.pending = [dict(zip(self.values, point)) for point in _points(self.values)]

    def add(self, scores: pd.DataFrame) -> list[dict]:
        """Record a round's scores; returns (and keeps in `pending`) the next round's points, [] when done."""
        self.scored = pd.concat([self.scored, scores], ignore_index=True)
        pick = self.pick()
        grown = {}
        for axis in self.axes:
            nxt, _ = axis.outward(self.values[axis.name], pick[axis.name])
            if nxt is not None and self.extensions[axis.name] < self.max_extensions and nxt not in self.values[axis.name]:
                grown[axis.name] = nxt
        self.pending = []
        for name, nxt in grown.items():
            self.extensions[name] += 1
            others = {n: v for n, v in self.values.items() if n != name}
            self.pending += [{**dict(zip(others, point)), name: nxt} for point in _points(others)]
            self.values[name] = sorted(self.values[name] + [nxt])
        return self.pending

    def table(self) -> pd.DataFrame:
        return self.scored.sort_values([*self.values], kind="stable").reset_index(drop=True)

    def pick(self) -> dict[str, float]:
        table = self.table()
        best = table.loc[table[self.objective].idxmin()]
        return {name: float(best[name]) for name in self.values}

    def result(self) -> GridResult:
        pick = self.pick()
        notes, bounded = [], set()
        for axis in self.axes:
            v = self.values[axis.name]
            if len(v) < 2 or pick[axis.name] not in (min(v), max(v)):
                continue
            _, note = axis.outward(v, pick[axis.name])
            if note:
                notes.append(note)
                bounded.add(axis.name)
            else:
                notes.append(f"{axis.name} {pick[axis.name]:g} is still at the edge of its grid after "
                             f"{self.extensions[axis.name]} extension(s) (the limit): the best value may lie beyond it")
        return GridResult(self.table(), pick, {k: list(v) for k, v in self.values.items()}, dict(self.extensions), notes,
                          frozenset(bounded))


def grid_search(axes: list[Axis], score: Callable[[list[dict]], pd.DataFrame], max_extensions: int = 3,
                objective: str = "kl") -> GridResult:
    """Score the grid of `axes` with `score(points)`, extending any axis whose pick is at its edge (`GridSearch`)."""
    search = GridSearch(axes, max_extensions, objective)
    while search.pending:
        search.add(score(search.pending))
    return search.result()


def grid_summary(result: GridResult) -> str:
    """One line: the pick, the grid it was chosen on, and any extension or edge note."""
    chosen = ", ".join(f"{name} {value:g}" for name, value in result.pick.items())
    grid = "; ".join(f"{name} in {{{', '.join(f'{v:g}' for v in values)}}}" for name, values in result.axes.items())
    grown = [f"{name} x{count}" for name, count in result.extensions.items() if count]
    text = f"chose {chosen} on {grid}"
    if grown:
        text += " (grid extended: " + ", ".join(grown) + ")"
    return text + "".join(f"; {note}" for note in result.notes)
