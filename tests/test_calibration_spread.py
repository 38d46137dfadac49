"""Calibration draws in an eval: the draws' variants, each method's spread across draws, and route agreement."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis.agreement import route_agreement
from ripplekv.analysis.calibration_spread import spread, spread_markdown
from ripplekv.pipeline.draws import draw_file, draw_variants
from ripplekv.pipeline.route import RouteResult


def _allocation(path, layers=4):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("layer,multiplier\n" + "".join(f"{i},1\n" for i in range(layers)))
    return path


def _route(path, layers=4):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("layer,method\n" + "".join(f"{i},snapkv\n" for i in range(layers)))
    return path


def test_every_calibrated_method_gets_a_variant_per_draw_whose_files_exist(tmp_path):
    allocation, depthkv = _allocation(tmp_path / "allocation.csv"), _allocation(tmp_path / "depthkv.csv")
    route = _route(tmp_path / "route" / "ROUTE.csv")
    for d in (1, 2):
        _allocation(draw_file(allocation, tmp_path, d))
        _allocation(draw_file(depthkv, tmp_path, d))
    _route(draw_file(route, tmp_path, 1))  # draw 2 has no route (its stage did not run)
    assert draw_file(route, tmp_path, 1) == tmp_path / "draws" / "d1" / "ROUTE-d1.csv"
    methods = f"full,snapkv,ripplekv,depthkv:allocation={depthkv}:scorer=snapkv,routed,routed-ripplekv"
    extra, table = draw_variants(methods, tmp_path, 3, {"allocation": str(allocation), "route": str(route)})
    d1, d2 = tmp_path / "draws" / "d1", tmp_path / "draws" / "d2"
    assert extra == [f"ripplekv:allocation={d1}/allocation-d1.csv", f"ripplekv:allocation={d2}/allocation-d2.csv",
                     f"depthkv:allocation={d1}/depthkv-d1.csv:scorer=snapkv",
                     f"depthkv:allocation={d2}/depthkv-d2.csv:scorer=snapkv",
                     f"routed:route={d1}/ROUTE-d1.csv",
                     f"routed-ripplekv:allocation={d1}/allocation-d1.csv:route={d1}/ROUTE-d1.csv"]
    # Labels as eval writes them (file options by their name), draw 0 being the method itself.
    assert table.values.tolist() == [
        ["ripplekv", 0, "ripplekv"], ["ripplekv", 1, "ripplekv:allocation=allocation-d1.csv"],
        ["ripplekv", 2, "ripplekv:allocation=allocation-d2.csv"],
        ["depthkv:allocation=depthkv.csv:scorer=snapkv", 0, "depthkv:allocation=depthkv.csv:scorer=snapkv"],
        ["depthkv:allocation=depthkv.csv:scorer=snapkv", 1, "depthkv:allocation=depthkv-d1.csv:scorer=snapkv"],
        ["depthkv:allocation=depthkv.csv:scorer=snapkv", 2, "depthkv:allocation=depthkv-d2.csv:scorer=snapkv"],
        ["routed", 0, "routed"], ["routed", 1, "routed:route=ROUTE-d1.csv"],
        ["routed-ripplekv", 0, "routed-ripplekv"],
        ["routed-ripplekv", 1, "routed-ripplekv:allocation=allocation-d1.csv:route=ROUTE-d1.csv"]]
    none, empty = draw_variants("full,snapkv", tmp_path, 3, {"allocation": str(allocation)})
    assert none == [] and empty.empty and list(empty.columns) == ["method", "draw", "variant"]


def _lines(method, budget, kls, scores=None):
    return [{"task": task, "id": f"{task}{i}", "category": "c", "method": method, "budget": budget, "kl": kl,
             "score": (scores or [0.5] * len(kls))[i], "agreement": 1.0}
            for task in ("a", "b") for i, kl in enumerate(kls)]


def test_the_spread_sets_every_draws_mean_beside_draw_0s_interval_over_samples():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.4, 0.6, 20)
    frame = pd.DataFrame(_lines("snapkv", 64, base) + _lines("ripplekv", 64, base - 0.2)
                         + _lines("ripplekv:allocation=allocation-d1.csv", 64, base - 0.1)
                         + _lines("ripplekv:allocation=allocation-d2.csv", 64, base + 0.1)
                         + _lines("ripplekv:allocation=allocation-d2.csv", 128, base))  # draw 0 never ran 128
    draws = pd.DataFrame({"method": ["ripplekv"] * 3, "draw": [0, 1, 2],
                          "variant": ["ripplekv", "ripplekv:allocation=allocation-d1.csv", "ripplekv:allocation=allocation-d2.csv"]})
    summary, per_draw = spread(frame, draws)
    assert len(summary) == 1 and summary["budget"].item() == 64 and summary["draws"].item() == 3
    row = summary.iloc[0]
    means = [base.mean() - 0.2, base.mean() - 0.1, base.mean() + 0.1]
    assert row["kl_draw0"] == pytest.approx(means[0]) and row["kl_draw_sd"] == pytest.approx(np.std(means, ddof=1))
    assert row["kl_draw_max"] - row["kl_draw_min"] == pytest.approx(0.3)
    assert row["kl_ci_low"] < row["kl_draw0"] < row["kl_ci_high"] and row["sd_over_half_width"] > 1
    # Draws 0 and 1 are clearly below SnapKV (paired: every sample moves by the same amount), draw 2 above it.
    assert row["draws_closer"] == 2 and row["draws_further"] == 1
    assert row["verdict_by_draw"] == "closer / closer / further"
    assert list(per_draw["kl_delta"]) == pytest.approx([-0.2, -0.1, 0.1])
    assert (per_draw["p_kl_holm"] >= per_draw["p_kl"]).all() and (per_draw["p_kl_holm"] < 0.05).all()
    assert row["kl_by_draw"] == " / ".join(f"{m:.3f}" for m in means)
    table = spread_markdown(summary)
    assert "ripplekv" in table and "SD / CI half-width" in table and "KL - snapkv by draw" in table
    # A draws' run of calibrated rows alone (the study's) has no baseline: no column for one, not "KL - nan".
    alone = spread_markdown(summary.assign(baseline=np.nan))
    assert "by draw (Holm" not in alone and "nan" not in alone and "SD / CI half-width" in alone


def test_draws_are_compared_on_the_samples_every_draw_ran():
    frame = pd.DataFrame(_lines("ripplekv", 64, [0.1, 0.2, 0.3]) + _lines("ripplekv:x=1", 64, [0.1, 0.2]))
    draws = pd.DataFrame({"method": ["ripplekv"] * 2, "draw": [0, 1], "variant": ["ripplekv", "ripplekv:x=1"]})
    summary, _ = spread(frame, draws)
    assert summary["samples"].item() == 4 and summary["kl_draw0"].item() == pytest.approx(0.15)


def test_route_agreement_counts_layers_and_its_chance_level():
    assert route_agreement(["a", "a", "b", "b"], ["a", "b", "b", "b"]) == {"agreement": 3, "layers": 4, "chance": 2.0}
    # Two routes that pick one method everywhere agree everywhere, and so would any shuffle of them.
    assert route_agreement(["a"] * 5, ["a"] * 5) == {"agreement": 5, "layers": 5, "chance": 5.0}
    with pytest.raises(ValueError):
        route_agreement(["a"], ["a", "b"])


def test_the_route_records_its_split_half_agreement():
    # Layer 0 prefers a on every prompt; layer 1 prefers a on even prompts and b on odd ones.
    prefs = np.array([[[0.1, 0.9], [0.1, 0.9]], [[0.1, 0.9], [0.9, 0.1]], [[0.1, 0.9], [0.1, 0.9]], [[0.1, 0.9], [0.9, 0.1]]])
    result = RouteResult(["a", "b"], ["p0", "p1", "p2", "p3"], prefs, ["a", "a"], {"a": 2, "b": 2}, [], [],
                         np.zeros((0, 0)), np.zeros((0, 0)))
    half = result.split_half()
    assert half["routes"] == [["a", "a"], ["a", "b"]] and half["agreement"] == 1 and half["chance"] == 1.0
    assert half["samples"] == [2, 2]
    one = RouteResult(["a", "b"], ["p0"], prefs[:1], ["a", "a"], {"a": 2, "b": 2}, [], [], np.zeros((0, 0)), np.zeros((0, 0)))
    assert one.split_half() is None
