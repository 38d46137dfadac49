"""check-references for FinchPress, SimLayerKVPress and KVgradPress: what each needs beyond the scorer presses' hook.

Runs in the reference venv (`check_references_worker` calls it), each press's own code choosing:
- FinchPress: kvpress finds the question by a delimiter token it adds to the vocabulary and drops from the
  embeddings, so the prompt the model reads is the same as without it. Here no token is added: the press's
  `window_size` (what its embedding hook would set) is the prompt's question part as our side cut it, the task's own
  context/question split (`questions.json`), and its `compress` runs in the eager hook like the scorer presses (it
  re-rotates the kept keys; the "values" it gathers are positions, so what it returns is what it kept).
- SimLayerKVPress: its `compress` in the eager hook, once per layer (its compression ratio is not settable: it keeps
  what its threshold gives at every budget), at `SIMLAYERKV_THRESHOLD`.
- KVgradPress: as KVzipPress runs (`check_references_worker.kvzip_kept`): prefill under the press, its own replay with
  a forward and a backward pass per chunk, its final selection made once per budget from the one scoring.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SIMLAYERKV_THRESHOLD = 0.9  # our default (kvpress's own, 1.0, makes no layer lazy); the pair's spec says it too


def questions(out: Path) -> dict[str, int]:
    """Where each prompt's question part begins, as our side cut it ({prompt file stem: index})."""
    path = out / "questions.json"
    return json.loads(path.read_text()) if path.exists() else {}


def special_presses(keys: set[str]) -> dict:
    """The presses among finch, simlayerkv asked for (`keys`), made with kvpress's defaults."""
    from kvpress import FinchPress, SimLayerKVPress

    made = {"finch": FinchPress, "simlayerkv": lambda: SimLayerKVPress(lazy_threshold=SIMLAYERKV_THRESHOLD)}
    return {key: build() for key, build in made.items() if key in keys}


def simlayerkv_kept(press, module, hidden, keys, attentions, kwargs, padded) -> np.ndarray:
    """The positions SimLayerKVPress's `compress` keeps in this layer (positions in place of the values)."""
    import torch

    n = keys.shape[2]
    positions = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(*keys.shape[:3], 1).contiguous()
    _, kept = press.compress(module, hidden, keys, positions, attentions, kwargs)
    return padded(list(kept[0, :, :, 0].round().long().numpy()))
