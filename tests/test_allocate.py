"""Allocation: mean 1, disparity exactly R, monotone in sensitivity, R=1 uniform, exact totals."""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.pipeline.allocate import multipliers, read_sensitivity, write_allocation

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
        read_sensitivity(path, layers)


def test_ratio_below_one_is_rejected():
    with pytest.raises(UserError, match=">= 1"):
        multipliers([1.0, 2.0], 0.5)
    with pytest.raises(UserError, match=">= 1"):
        multipliers([1.0, 2.0], math.nan)
