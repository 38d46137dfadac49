"""pipeline.grid: a pick at the grid's edge extends the grid, within a limit, and says where it stopped."""

from __future__ import annotations

import pandas as pd
import pytest

from ripplekv.pipeline.grid import Axis, grid_search, grid_summary


def scorer(best: dict[str, float], calls: list):
    """KL = squared log-distance to `best` (lowest at it); records each call's points."""
    import math

    def score(points):
        calls.append(points)
        return pd.DataFrame([{**p, "kl": sum(math.log(p[k] / best[k]) ** 2 for k in best)} for p in points])

    return score


def test_a_pick_inside_the_grid_is_kept_and_nothing_more_is_scored():
    calls = []
    result = grid_search([Axis("ratio", (2, 4, 8), low=1)], scorer({"ratio": 4}, calls))
    assert result.pick == {"ratio": 4.0} and result.extensions == {"ratio": 0} and not result.notes
    assert len(calls) == 1 and not result.at_edge


def test_a_pick_at_the_top_doubles_until_bracketed_scoring_only_new_points():
    calls = []
    result = grid_search([Axis("ratio", (2, 4, 8), low=1)], scorer({"ratio": 16}, calls))
    # 8 is the edge -> 16 is scored; 16 is then the edge -> 32; 16 is inside {2, 4, 8, 16, 32}.
    assert result.pick == {"ratio": 16.0} and result.axes["ratio"] == [2, 4, 8, 16, 32]
    assert [[p["ratio"] for p in call] for call in calls] == [[2, 4, 8], [16], [32]]
    assert result.extensions == {"ratio": 2} and not result.at_edge and not result.notes
    assert "chose ratio 16" in grid_summary(result) and "extended: ratio x2" in grid_summary(result)


def test_the_limit_stops_the_extension_and_the_edge_is_noted():
    result = grid_search([Axis("ratio", (2, 4, 8), low=1)], scorer({"ratio": 1000}, []), max_extensions=2)
    assert result.pick == {"ratio": 32.0} and result.at_edge
    assert result.notes == ["ratio 32 is still at the edge of its grid after 2 extension(s) (the limit): "
                            "the best value may lie beyond it"]
    assert grid_search([Axis("ratio", (2, 4), low=1)], scorer({"ratio": 1000}, []), max_extensions=0).axes == {"ratio": [2, 4]}


def test_downwards_it_stops_at_the_knobs_own_bound_and_says_so():
    calls = []
    result = grid_search([Axis("ratio", (2, 4, 8), low=1)], scorer({"ratio": 0.5}, calls))
    # 2 is the lowest -> 1 (the bound: uniform) is scored; 1 is then the pick and nothing lies below it.
    assert result.pick == {"ratio": 1.0} and [[p["ratio"] for p in c] for c in calls] == [[2, 4, 8], [1]]
    assert result.notes == ["ratio 1 is its smallest meaningful value"] and not result.at_edge


def test_two_axes_extend_each_at_its_own_edge_keeping_a_full_grid():
    calls = []
    result = grid_search([Axis("tau1", (0.5, 1, 2)), Axis("tau2", (0.5, 1, 2))], scorer({"tau1": 4, "tau2": 1}, calls))
    assert result.pick == {"tau1": 4.0, "tau2": 1.0} and result.axes["tau2"] == [0.5, 1, 2]
    assert result.axes["tau1"] == [0.5, 1, 2, 4, 8]
    # The new tau1 value is scored with every tau2 value: 3 + 3 + 3 points in all.
    assert [len(c) for c in calls] == [9, 3, 3] and len(result.table) == 15


def test_ties_go_to_the_smallest_values():
    flat = lambda points: pd.DataFrame([{**p, "kl": 0.0} for p in points])  # noqa: E731
    assert grid_search([Axis("beta", (5, 10, 20), low=1)], flat, max_extensions=0).pick == {"beta": 5.0}
    # A flat surface still counts as a pick at the edge: it steps down to the bound (5 -> 2.5 -> 1.25 -> 1).
    assert grid_search([Axis("beta", (5, 10, 20), low=1)], flat).axes["beta"] == [1, 1.25, 2.5, 5, 10, 20]
    with pytest.raises(ValueError):
        grid_search([Axis("beta", (5, 10))], lambda points: None, max_extensions=-1)
