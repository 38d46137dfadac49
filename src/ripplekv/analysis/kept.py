"""`ripplekv inspect`: which entries a method kept for one prompt, as data and as a picture.

A researcher asks *why* a method lost an answer: was the needle evicted, in which layers and heads,
and how much of the question survived? `kept.npz` holds, per layer and KV head, the prompt positions
kept (and the span each prototype stands for); the png draws them (position on x, layer x head on y)
with the question and the answer's occurrences in the context marked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ripplekv.engine.entries import LayerEntries
from ripplekv.runs.safeio import save_figure


def kept_arrays(built: list[LayerEntries]) -> dict[str, np.ndarray]:
    """positions/log_weights [L, H, K] (-1 / -inf on padding), spans [L, H, K, 2], counts [L, H]."""
    layers, heads = len(built), built[0].num_heads
    width = max(layer.capacity for layer in built)
    positions = np.full((layers, heads, width), -1, dtype=np.int64)
    weights = np.full((layers, heads, width), -np.inf, dtype=np.float32)
    spans = np.full((layers, heads, width, 2), -1, dtype=np.int64)
    counts = np.zeros((layers, heads), dtype=np.int64)
    for index, layer in enumerate(built):
        k = layer.capacity
        pos = layer.positions.cpu().numpy()
        positions[index, :, :k] = pos
        bias = layer.bias()
        weights[index, :, :k] = 0.0 if bias is None else bias.cpu().numpy()
        if layer.spans is not None:
            spans[index, :, :k] = layer.spans.cpu().numpy()
        else:
            spans[index, :, :k, 0] = pos
            spans[index, :, :k, 1] = np.where(pos >= 0, pos + 1, -1)
        counts[index] = layer.counts.cpu().numpy()
    return {"positions": positions, "log_weights": weights, "spans": spans, "counts": counts}


def answer_positions(ids: list[int], tokenizer, answers: list[str], end: int) -> list[int]:
    """Token indices (before `end`) covering an occurrence of any answer string in the context."""
    pieces = [tokenizer.decode([token]) for token in ids[:end]]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = "".join(pieces)
    found: set[int] = set()
    for answer in answers:
        answer = str(answer).strip()
        if not answer:
            continue
        at = text.find(answer)
        while at >= 0:
            first = int(np.searchsorted(starts, at, side="right")) - 1
            last = int(np.searchsorted(starts, at + len(answer), side="left")) - 1
            found.update(range(first, last + 1))
            at = text.find(answer, at + 1)
    return sorted(found)


def coverage(arrays: dict[str, np.ndarray], length: int) -> np.ndarray:
    """[L*H, n] map: 1 where a token is kept itself, 0.5 where a prototype stands for it, 0 evicted."""
    layers, heads, _ = arrays["positions"].shape
    image = np.zeros((layers * heads, length), dtype=np.float32)
    for layer in range(layers):
        for head in range(heads):
            row = layer * heads + head
            for start, end in arrays["spans"][layer, head]:
                if start < 0:
                    continue
                image[row, start:end] = np.maximum(image[row, start:end], 1.0 if end - start == 1 else 0.5)
    return image


def plot_kept(path: Path, arrays: dict, length: int, question: int, needles: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads, _ = arrays["positions"].shape
    image = coverage(arrays, length)
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.06 * layers * heads + 1.5)))
    ax.imshow(image, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1,
              extent=(0, length, layers * heads, 0))
    ax.axvspan(question, length, color="tab:blue", alpha=0.12, label=f"question and instructions ({length - question} tokens)")
    for index, position in enumerate(needles):
        ax.axvline(position + 0.5, color="tab:red", lw=0.8, alpha=0.8, label="answer in the context" if index == 0 else None)
    ax.set_yticks([layer * heads for layer in range(0, layers, max(1, layers // 10))])
    ax.set_yticklabels([str(layer) for layer in range(0, layers, max(1, layers // 10))])
    ax.set_xlabel("prompt position (black: kept token; grey: inside a prototype)")
    ax.set_ylabel(f"layer (x {heads} KV heads)")
    ax.set_title(title, fontsize=9)
    if question < length or needles:
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
