"""Allocation: mean 1, disparity exactly R, monotone in sensitivity, R=1 uniform, exact totals."""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.pipeline.allocate import (
    map_label,
    multipliers,
    proportional_multipliers,
    read_profile_sensitivity,
    write_allocation,
)

profiles = st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=2, max_size=40).filter(
    lambda s: max(s) - min(s) > 1e-6
)


@settings(max_examples=200, deadline=None)
@given(sensitivity=profiles, ratio=st.floats(1.0, 64.0))
def test_mapping_properties(sensitivity, ratio):
    m = multipliers(sensitivity, ratio)
    assert m.mean() == pytest.approx(1.0, rel=1e-9)
    assert m.max() / m.min() == pytest.approx(ratio, rel=1e-9)
    order = np.argsort(sensitivity, kind="stable")
    assert (np.diff(m[order]) >= -1e-12).all()  # more sensitive never gets less


def test_ratio_one_and_flat_profiles_are_uniform():
    assert np.allclose(multipliers([0.1, 5.0, 2.0], 1.0), 1.0)
    assert np.allclose(multipliers([3.0, 3.0, 3.0], 8.0), 1.0)


def test_exponential_shape():
    m = multipliers([0.0, 0.5, 1.0], 4.0)
    assert m[1] / m[0] == pytest.approx(2.0) and m[2] / m[0] == pytest.approx(4.0)


@settings(max_examples=100, deadline=None)
@given(sensitivity=profiles, ratio=st.floats(1.0, 64.0), budget=st.integers(1, 700), length=st.integers(50, 5000))
def test_ripplekv_budgets_sum_exactly_under_clamping(sensitivity, ratio, budget, length):
    method = make_method("ripplekv", multipliers=tuple(multipliers(sensitivity, ratio)))
    counts = method.layer_budgets(len(sensitivity), budget, length)
    assert sum(counts) == len(sensitivity) * min(budget, length)
    assert max(counts) <= length


def test_allocation_csv_round_trips_into_the_method(tmp_path):
    values = np.array([0.2, 0.9, 0.1, 0.4])
    m = multipliers(values, 4.0)
    write_allocation(tmp_path / "alloc.csv", values, m)
    table = pd.read_csv(tmp_path / "alloc.csv")
    assert list(table.columns) == ["layer", "sensitivity", "multiplier", "map"]
    assert (table["map"] == "exponential").all()
    method = make_method("ripplekv", allocation=str(tmp_path / "alloc.csv"))
    assert np.allclose(method.allocator.multipliers, m)


@pytest.mark.parametrize(
    "text, layers, message",
    [
        ("layer,kl\n0,1\n", None, "lacks column"),
        ("layer,kl_mean\n0,1\n1,2\n", 3, "has 2 layers but the model has 3"),
        ("layer,kl_mean\n0,1\n1,-2\n", None, "negative"),
        ("", None, "not a readable CSV"),
    ],
)
def test_bad_sensitivity_files(tmp_path, text, layers, message):
    path = tmp_path / "s.csv"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        read_profile_sensitivity(path, layers)


def test_ratio_below_one_is_rejected():
    with pytest.raises(UserError, match=">= 1"):
        multipliers([1.0, 2.0], 0.5)
    with pytest.raises(UserError, match=">= 1"):
        multipliers([1.0, 2.0], math.nan)


# --------------------------------------------------------------------------- DepthKV's proportional map, bounded

bounded_profiles = st.lists(st.floats(0.0, 100.0, allow_nan=False, allow_subnormal=False), min_size=2, max_size=40).filter(
    lambda s: sum(s) > 1e-6
)


def test_proportional_map_without_bounds_is_unchanged():
    s = np.array([0.2, 0.6, 0.0, 0.2, 1e-9])
    assert np.array_equal(proportional_multipliers(s), s / s.mean())
    assert np.array_equal(proportional_multipliers(s, None, None), s / s.mean())
    assert map_label("proportional") == "proportional" and map_label("proportional", 0.25, 4.0) == "proportional:floor=0.25:cap=4"


def test_floor_and_cap_keep_the_mean_at_one():
    # [0.8, 2.4, 0, 0.8] clipped into [0.5, 2]: the zero layer sits at 0.5, the top at 2, the rest share the remainder.
    m = proportional_multipliers([0.2, 0.6, 0.0, 0.2], floor=0.5, cap=2.0)
    assert m == pytest.approx([0.75, 2.0, 0.5, 0.75], rel=1e-9)
    # Floor alone: the zero layer is lifted to 0.5 and the others give it back in proportion (t = 0.875).
    assert proportional_multipliers([0.2, 0.6, 0.0, 0.2], floor=0.5) == pytest.approx([0.7, 2.1, 0.5, 0.7], rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(sensitivity=bounded_profiles, floor=st.floats(0.0, 1.0), cap=st.floats(1.0, 16.0),
       budget=st.integers(8, 512), length=st.integers(600, 20000))
def test_bounded_proportional_map_properties(sensitivity, floor, cap, budget, length):
    s = np.asarray(sensitivity)
    positive = int((s > 0).sum())
    reachable = (positive * cap + (len(s) - positive) * floor) / len(s)  # the largest mean the bounds allow
    if reachable < 1 - 1e-9:
        with pytest.raises(UserError, match="cannot keep the mean multiplier at 1"):
            proportional_multipliers(s, floor, cap)
        return
    assume(reachable > 1 + 1e-9 or reachable == 1)  # not within rounding of the edge
    m = proportional_multipliers(s, floor, cap)
    assert m.mean() == pytest.approx(1.0, rel=1e-9)
    assert m.min() >= floor - 1e-12 and m.max() <= cap + 1e-12
    order = np.argsort(s, kind="stable")
    assert (np.diff(m[order]) >= -1e-12).all()  # more sensitive never gets less
    # DepthKV's budgets from the bounded multipliers: exact totals, each layer within the bounds (+ rounding).
    counts = make_method("depthkv", multipliers=tuple(m)).layer_budgets(len(s), budget, length)
    assert sum(counts) == len(s) * budget
    assert all(max(1, math.floor(floor * budget)) <= c <= math.ceil(cap * budget) for c in counts)


def test_bounds_that_cannot_hold_or_are_out_of_range_are_refused():
    with pytest.raises(UserError, match="cannot keep the mean multiplier at 1"):
        proportional_multipliers([0.0, 0.0, 0.0, 1.0], cap=2.0)  # 3 layers of sensitivity 0, one capped at 2: mean 0.5
    for floor, cap, message in [(1.5, None, "--floor must be"), (-0.1, None, "--floor must be"),
                                (None, 0.5, "--cap must be"), (None, math.inf, "--cap must be")]:
        with pytest.raises(UserError, match=message):
            proportional_multipliers([0.1, 0.2], floor, cap)
