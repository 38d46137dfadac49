"""check-references' comparison for key channels, merging and re-rotation (scripts/check_references_axes.py): our
stored arrays against the reference's, on a tiny model's prefill; the reference venv itself is not part of the
tests, so its side is written here from ours, then perturbed to show the check fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from check_references_axes import AXES, compare_axes, save_ours  # noqa: E402

from ripplekv.engine.prefill import Requirements, prefill_for  # noqa: E402
from ripplekv.methods import make_method  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402

BUDGETS = [40]


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    out = tmp_path_factory.mktemp("axes")
    needs = Requirements.of_all(make_method(spec) for spec in AXES.values())
    state = prefill_for(tiny_llama(num_key_value_heads=2), torch.arange(150) % 91 + 4, needs)
    save_ours(state, out, 0, BUDGETS, list(AXES))
    return out, state.num_layers


def as_reference(out: Path, change=None) -> None:
    """The reference's file written from ours (its layout: kept channel masks; positions and rows unpadded, in
    another order), `change(name, array)` applied to each array first."""
    saved = np.load(out / "axes_ours_0.npz")
    d = next(saved[key].shape[-1] for key in saved.files if key.endswith("/tensor"))
    record = {}
    for key in saved.files:
        if key == "meta":
            continue
        name, rest = key.split("/", 1)
        array = saved[key]
        if key.endswith("/channels"):
            mask = np.zeros((array.shape[0], d), dtype=bool)
            np.put_along_axis(mask, array, True, axis=1)
            record[key.replace("/channels", "/kept")] = mask
            continue
        if key.endswith("/positions"):
            record[key] = array[:, ::-1].copy()  # another order: the comparison sorts by position
            continue
        record[key] = array[:, ::-1].copy()
    for key in list(record):
        if change is not None:
            record[key] = change(key, record[key])
    np.savez(out / "axes_reference_0.npz", **record)


def test_the_comparison_passes_on_the_same_arrays_and_fails_on_perturbed_ones(ours):
    out, layers = ours
    meta = json.loads(str(np.load(out / "axes_ours_0.npz")["meta"]))
    assert meta["names"] == list(AXES) and meta["entry_budgets"]["40"] > 40  # think's bytes bought entries
    as_reference(out)
    lines = compare_axes(out, layers, BUDGETS)
    assert [name for name, _, _ in lines] == list(AXES)
    assert all(ok for _, ok, _ in lines), lines
    assert all(" 1.0000 of " in text for _, _, text in lines)

    def shaken(key, array):
        if key.endswith("/tensor"):
            return array * 1.01  # one percent off: beyond the tolerance
        if key.endswith("/kept"):
            return np.roll(array, 1, axis=1)  # other channels
        return array

    as_reference(out, shaken)
    assert not any(ok for _, ok, _ in compare_axes(out, layers, BUDGETS))


def test_only_refuses_a_name_no_check_knows_before_making_anything(tmp_path, monkeypatch, capsys):
    from tests.conftest import script_refusal

    err = script_refusal("check_references", "--only", "think,thinkk", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert err.startswith("error: --only takes pair names (") and err.rstrip().endswith("got thinkk")
    assert "merge=cam" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_axis_checked_alone_needs_no_chunk_press():
    """`check_references.py --only blockwise` (an axis alone) runs the worker with no press of the chunk pairs: the
    scores that tell their ties apart are recorded only for the presses that run (a KeyError before)."""
    from check_references_chunks import chunk_scores

    keys = torch.randn(1, 2, 10, 8)
    assert chunk_scores({}, None, None, keys, None, {}, 0) == {}
    assert list(chunk_scores({"chunkpress": object()}, None, None, keys, None, {}, 3)) == ["chunkpress_scores/3"]


def test_rerotated_keys_may_differ_by_their_angles_float32_rounding_and_no_more():
    """Re-rotation turns keys by angles up to n radians on both sides in float32: the allowed gap grows with the
    prompt (4 n 2^-24 on top of 1e-4), the other options keep 1e-4 whatever the length."""
    from check_references_axes import TOLERANCE, tolerance

    assert tolerance("merge=kvpress", 3567) == TOLERANCE == tolerance("merge=kvpress", 100)
    assert tolerance("rerotate", 3567) == pytest.approx(1e-4 + 4 * 3567 / 2**24)  # 9.5e-4: 1.8e-4 was measured
    assert tolerance("rerotate", 100) < 1.3e-4


def test_a_tied_swap_compares_scores_only_where_the_press_scored():
    """A press's scores may stop short of the window both sides keep: those positions must match, the rest compare
    by their scores (a crash on the first full-size run of every pair)."""
    from check_references import tied_swap

    scores = np.array([[1.0, 2.0, 2.0, 0.5]])  # positions 4 and 5: the window, unscored
    assert tied_swap(scores, 0, {1, 4, 5}, {2, 4, 5})  # 1 and 2 tie
    assert not tied_swap(scores, 0, {1, 4, 5}, {3, 4, 5})  # 2.0 against 0.5
    assert not tied_swap(scores, 0, {1, 2, 4}, {1, 2, 5})  # the window differs
