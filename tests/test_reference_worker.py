"""check-references' reference side (scripts/check_references_*.py) where it runs without kvpress: what a run with
`--only` asks of it (the reference venv itself is not part of the tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from check_references_chunks import chunk_scores  # noqa: E402


class RankingPress:
    """A stand-in for LagKVPress: scores each key by its position."""

    def score(self, module, hidden, keys, values, attentions, kwargs):
        return torch.arange(keys.shape[2], dtype=torch.float32).expand(keys.shape[:3])


def test_chunk_scores_records_only_the_presses_a_run_asked_for():
    keys = torch.randn(1, 2, 6, 4)
    assert chunk_scores({}, None, None, keys, keys, {}, 3) == {}  # --only finch: no LagKV, no ChunkPress
    lag = chunk_scores({"lagkv": RankingPress()}, None, None, keys, keys, {}, 3)
    assert list(lag) == ["lagkv_scores/3"] and lag["lagkv_scores/3"].tolist() == [list(range(6))] * 2
    knorm = chunk_scores({"chunkpress": object()}, None, None, keys, keys, {}, 3)
    assert list(knorm) == ["chunkpress_scores/3"]
    assert torch.allclose(torch.as_tensor(knorm["chunkpress_scores/3"]), -keys[0].norm(dim=-1))
