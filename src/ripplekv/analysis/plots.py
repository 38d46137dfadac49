"""Matplotlib for files, and one look per method that every plot of a report shares.

Every command that draws (report, profile, allocate, route) gets pyplot here. A report compares twenty
methods or more, so colour alone cannot tell them apart: each method gets a colour from a qualitative
palette *and* a marker, assigned so that no two methods share both (the i-th method: colour i mod 9,
marker i mod 11, so the pairs repeat only after 99 methods, and neighbours differ in both); every 9
methods the line style changes and the markers turn hollow (then filled again), so two methods of one
colour also differ in line, marker and fill. Styles follow the run's method order, so a method keeps its
look whatever its rank. Grey is kept for answer-aware variants (drawn hollow), black for the full cache.
"""

from __future__ import annotations

from dataclasses import dataclass

# matplotlib's tab10 without its grey, which is kept for answer-aware variants
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
LINES = ("-", "--", "-.", ":")
AWARE_COLOUR = "#7f7f7f"


@dataclass(frozen=True)
class Style:
    """How one method is drawn in every plot of a report."""

    colour: str
    marker: str
    line: str
    hollow: bool = False

    @property
    def face(self) -> str:
        """The marker's fill: its colour, or white when hollow."""
        return "white" if self.hollow else self.colour


def series_styles(labels) -> dict[str, Style]:
    """A distinct (colour, marker) per label, in order of first appearance."""
    styles = {}
    for i, label in enumerate(dict.fromkeys(labels)):
        cycle = i // len(PALETTE)
        styles[label] = Style(PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)], LINES[cycle % len(LINES)],
                              hollow=cycle % 2 == 1)
    return styles


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed; imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
