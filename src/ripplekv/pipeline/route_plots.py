"""The route's figures: mean KL per (layer, candidate), the chosen route, and where the route ranks among
the random placements (written by `route.write_route`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ripplekv.analysis.plots import pyplot
from ripplekv.runs.safeio import save_figure


def plot_preferences(mean: np.ndarray, labels, route, path: Path) -> None:
    """Heat map of log10 KL per (layer, method); the route's choice is circled."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(labels), 1.4 + 0.22 * mean.shape[0]))
    image = ax.imshow(np.log10(np.maximum(mean, 1e-12)), aspect="auto", cmap="viridis")
    chosen = [labels.index(m) for m in route]
    ax.scatter(chosen, np.arange(len(route)), s=40, facecolors="none", edgecolors="red")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("layer")
    ax.set_title("log10 KL, one layer compressed (circled: the route)", fontsize=9)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_route(mean: np.ndarray, labels, route, path: Path) -> None:
    """Per-layer KL of every candidate, with the method the route takes in each layer marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    layers = np.arange(mean.shape[0])
    for index, label in enumerate(labels):
        ax.plot(layers, np.maximum(mean[:, index], 1e-12), marker=".", lw=1, label=label)
    chosen = mean[layers, [labels.index(m) for m in route]]
    ax.scatter(layers, np.maximum(chosen, 1e-12), s=60, facecolors="none", edgecolors="black", label="route")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("KL(full || one layer compressed)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_placements(placements: pd.DataFrame, rank, path: Path) -> None:
    """Histogram of the random placements' KL with the profile-guided route marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    others = placements[~placements["is_route"]]["kl"]
    ax.hist(others, bins=min(30, max(5, len(others) // 3)), color="tab:grey", alpha=0.8, label="random placements")
    route_kl = float(placements[placements["is_route"]]["kl"].iloc[0])
    ax.axvline(route_kl, color="red", lw=2, label=f"route (rank {rank} of {len(placements)})")
    ax.set_xlabel("teacher-forced KL(full || placement)")
    ax.set_ylabel("placements")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
