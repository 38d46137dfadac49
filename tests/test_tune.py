"""`ripplekv tune`: baselines' knobs chosen on calibration prompts, with the grid extended past an edge pick."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ripplekv.errors import UserError
from ripplekv.pipeline.tune import apply_tuned, parse_grid
from tests.conftest import invoke as run


def test_a_grid_is_a_spec_whose_options_list_values():
    grid = parse_grid("cake:window=16:tau1=0.5,1,2:tau2=1,2")
    assert grid.base == "cake:window=16" and [a.name for a in grid.axes] == ["tau1", "tau2"]
    assert grid.spec({"tau1": 2.0, "tau2": 0.5}) == "cake:tau1=2:tau2=0.5:window=16"
    # Stepping out stops where the method refuses the value (PyramidKV's beta is at least 1).
    beta = parse_grid("pyramidkv:beta=2,20").axes[0]
    assert beta.outward([2.0, 20.0], 2.0) == (1.0, None)
    assert beta.outward([1.0, 2.0], 1.0) == (None, "beta 1 is at the edge of the values it takes (0.5 is refused)")


@pytest.mark.parametrize("text, message", [
    ("cake", "lists no values to choose among"),
    ("nosuch:tau1=1,2", "unknown method 'nosuch'"),
    ("cake:tau1=1,x", "tau1 must list numbers"),
    ("pyramidkv:beta=0.5,10", "option beta must be a number >= 1"),
    ("cake:gamma=1,2", "unknown option(s) gamma"),
])
def test_a_bad_grid_is_one_line(text, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_grid(text)


def test_tuned_specs_replace_the_methods_they_tune_and_nothing_else():
    tuned = {"cake": "cake:tau1=2:tau2=1", "pyramidkv": "pyramidkv:beta=10"}
    methods = "full,snapkv,pyramidkv,cake,cake:tau1=4,pyramidkv:scorer=h2o,ripplekv"
    assert apply_tuned(methods, tuned) == \
        "full,snapkv,pyramidkv:beta=10,cake:tau1=2:tau2=1,cake:tau1=4,pyramidkv:scorer=h2o,ripplekv"


def test_tune_picks_the_lowest_kl_and_brackets_or_notes_it(tiny_model_dir, tmp_path):
    out = tmp_path / "tune.json"
    result = run("tune", "cake:tau1=0.5,1:tau2=1,2", "pyramidkv:beta=5,20", "--model", tiny_model_dir, "--budget", 32,
                 "--calib-samples", 1, "--calib-draws", 2, "--calib-draw", 1, "--max-extensions", 1,
                 "--target-tokens", 300, "--out", out)
    assert result.returncode == 0, result.stderr
    tuned = json.loads(out.read_text())
    assert set(tuned["tuned"]) == {"cake", "pyramidkv"} and tuned["calib_draw"] == 1 and tuned["calib_draws"] == 2
    assert [sid[-5:] for sid in tuned["calibration_ids"]] == ["-0001"]  # draw 1 of 2: each task's sample 1, 3, ...
    table = pd.read_csv(out.with_suffix(".csv"))
    for base, entry in tuned["methods"].items():
        rows = table[table["method"] == base]
        assert entry["spec"] == rows.loc[rows["kl"].idxmin(), "spec"] == tuned["tuned"][base]
        assert rows["chosen"].sum() == 1 and rows.loc[rows["chosen"], "spec"].item() == entry["spec"]
        for knob, values in entry["axes"].items():
            pick = entry["pick"][knob]
            assert min(values) < pick < max(values) or entry["notes"] or len(values) == 1, entry
            assert entry["extensions"][knob] <= 1
    assert not list(tmp_path.glob(".tune.*.jsonl"))  # the scratch logs are gone
    assert "cake: chose tau1" in result.stderr
