"""Matplotlib for files: every command that draws (report, profile, allocate, route) gets pyplot here."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed; imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
