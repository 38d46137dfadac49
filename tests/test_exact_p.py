"""The report's p-values recomputed from its predictions by an independent brute-force sign-flip test and an
independent Holm adjustment: every sign pattern listed with itertools, nothing imported from the analysis code."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis import report

TASKS = {"niah": "Synthetic", "qa": "Single-Doc QA"}
IDS = {"niah": ["n0", "n1", "n2", "n3", "n4"], "qa": ["q0", "q1", "q2", "q3"]}
METHODS = ("snapkv", "alpha", "beta", "gamma")


def predictions(seed: int = 7) -> list[dict]:
    """Two tasks (niah scored 0/1, qa a fraction), the full cache and four methods at two budgets; no prediction
    text, so every task counts in the score."""
    rng = np.random.default_rng(seed)
    lines = []
    for task, ids in IDS.items():
        for sample in ids:
            lines.append({"id": sample, "task": task, "category": TASKS[task], "method": "full", "budget": None,
                          "score": 1.0, "kl": 0.0, "agreement": 1.0})
            for budget in (64, 128):
                for shift, method in enumerate(METHODS):
                    score = float(rng.random() < 0.8 - 0.15 * shift) if task == "niah" else round(rng.random(), 3)
                    lines.append({"id": sample, "task": task, "category": TASKS[task], "method": method,
                                  "budget": budget, "score": score, "kl": round(rng.gamma(2.0, 0.2) + 0.1 * shift, 4),
                                  "agreement": 0.9})
    return lines


def brute_force_p(differences: dict[tuple[str, str], float]) -> float:
    """Two-sided p of the mean over tasks of per-task mean differences, over all 2^n sign patterns."""
    keys = sorted(differences)
    count = {task: sum(1 for t, _ in keys if t == task) for task, _ in keys}
    weights = [1.0 / (len(count) * count[task]) for task, _ in keys]
    values = [differences[key] for key in keys]
    observed = abs(sum(w * v for w, v in zip(weights, values)))
    hits = total = 0
    for signs in itertools.product((1.0, -1.0), repeat=len(values)):
        total += 1
        hits += abs(sum(s * w * v for s, w, v in zip(signs, weights, values))) >= observed - 1e-12
    return hits / total


def holm_by_hand(p: list[float]) -> list[float]:
    """Holm's step-down adjustment, written out: sort, multiply by (m - rank), keep the running maximum."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    lines = predictions()
    (run / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tables = report.render(run, plots=False)
    return pd.DataFrame(lines), tables


@pytest.mark.parametrize("measure, column, p_name", [("kl", "kl", "p_kl_vs_uniform"), ("score", "score", "p_vs_uniform")])
def test_leaderboard_p_values_match_a_brute_force_sign_flip_and_holm_over_the_table(rendered, measure, column, p_name):
    frame, tables = rendered
    board = tables["leaderboard"]
    rows = board[board["method"].isin(METHODS[1:])]
    assert len(rows) == 6 and (rows["versus"] == "snapkv").all()
    expected = []
    for method, budget in zip(rows["method"], rows["budget"]):
        at = frame[frame["budget"] == budget].set_index(["task", "id", "method"])[column] * (100 if measure == "score" else 1)
        differences = {(t, i): at[(t, i, method)] - at[(t, i, "snapkv")] for t, ids in IDS.items() for i in ids}
        expected.append(brute_force_p(differences))
    assert rows[p_name].to_numpy() == pytest.approx(expected, abs=1e-12)  # at most 9 nonzero differences: exact
    assert rows[f"{p_name}_holm"].to_numpy() == pytest.approx(holm_by_hand(expected), abs=1e-12)  # one family
    assert len(set(expected)) > 3 and max(expected) > 0.3  # comparisons that differ, not all p = 1 or all tiny
    if measure == "kl":
        assert min(expected) < 0.05  # and one that Holm has to judge


def test_the_headline_holm_family_is_its_budgets(rendered):
    frame, tables = rendered
    headline = tables["headline"]
    headline = headline[headline["scope"] == "all methods"]
    assert list(headline["budget"]) == [64, 128]
    expected = []
    for budget, closest, runner in zip(headline["budget"], headline["closest"], headline["runner_up"]):
        at = frame[frame["budget"] == budget].set_index(["task", "id", "method"])["kl"]
        expected.append(brute_force_p({(t, i): at[(t, i, closest)] - at[(t, i, runner)]
                                       for t, ids in IDS.items() for i in ids}))
    assert headline["p_kl"].to_numpy() == pytest.approx(expected, abs=1e-12)
    assert headline["p_kl_holm"].to_numpy() == pytest.approx(holm_by_hand(expected), abs=1e-12)


def test_accuracy_intervals_stay_on_the_scale_and_every_row_has_its_n(rendered):
    _, tables = rendered
    board = tables["leaderboard"]
    assert (board["n"] == 9).all() and not board["fewer_samples"].any()
    for low, high in (("avg_ci_low", "avg_ci_high"), ("avg_informative_ci_low", "avg_informative_ci_high")):
        assert (board[low] >= 0).all() and (board[high] <= 100).all()
    compared = board["delta_ci_low"].notna()
    assert (board.loc[compared, "delta_ci_low"] >= -100).all() and (board.loc[compared, "delta_ci_high"] <= 100).all()
