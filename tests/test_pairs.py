"""Head-to-head tables: paired differences of two methods at each budget, over the samples both ran."""

from __future__ import annotations

import pandas as pd
import pytest

from ripplekv.analysis.pairs import head_to_head, head_to_head_markdown


def frame(shift: float) -> pd.DataFrame:
    rows = []
    for task in ("a", "b"):
        for i in range(6):
            for budget in (64, 128):
                base = 0.2 + 0.1 * (i % 3)
                rows.append({"task": task, "id": f"{task}{i}", "budget": budget, "method": "new", "score": base + shift,
                             "kl": 0.5 - shift + 0.01 * i})
                rows.append({"task": task, "id": f"{task}{i}", "budget": budget, "method": "old", "score": base,
                             "kl": 0.5 + 0.01 * i})
    rows.append({"task": "a", "id": "a-extra", "budget": 64, "method": "new", "score": 1.0, "kl": 0.0})  # old lacks it
    return pd.DataFrame(rows)


def test_a_constant_gain_on_every_sample_is_the_difference_with_a_zero_width_interval():
    table = head_to_head(frame(0.1), "new", "old").set_index("budget")
    assert list(table.index) == [64, 128] and (table["samples"] == 12).all()  # the unpaired extra sample is left out
    assert table["score_delta"].tolist() == pytest.approx([10.0, 10.0])
    assert table["kl_delta"].tolist() == pytest.approx([-0.1, -0.1])
    assert table["score_ci_low"].tolist() == pytest.approx([10.0, 10.0]) and table["kl_ci_high"].tolist() == pytest.approx([-0.1, -0.1])
    # 12 samples, every one better: exact sign-flip p = 2 / 2^12, Holm over the two budgets doubles it.
    assert table["p_score"].tolist() == pytest.approx([2 / 4096] * 2) and table["p_kl_holm"].tolist() == pytest.approx([4 / 4096] * 2)
    text = head_to_head_markdown(table.reset_index())
    assert "+10.00 [+10.00, +10.00]" in text and "score, new - old" in text and "better" in text and "closer" in text


def test_methods_that_share_no_budget_give_an_empty_table():
    data = frame(0.0)
    data.loc[data["method"] == "old", "budget"] = 256
    assert head_to_head(data, "new", "old").empty


def test_scores_can_be_limited_to_the_informative_tasks():
    data = frame(0.1)
    data.loc[(data["task"] == "b") & (data["method"] == "new"), "score"] -= 0.5  # task b: the new one far worse
    both = head_to_head(data, "new", "old").set_index("budget")
    only_a = head_to_head(data, "new", "old", counted=["a"]).set_index("budget")
    assert both.loc[128, "score_delta"] == pytest.approx(-15.0) and only_a.loc[128, "score_delta"] == pytest.approx(10.0)
    assert only_a.loc[128, "kl_delta"] == pytest.approx(both.loc[128, "kl_delta"])  # KL keeps every task
