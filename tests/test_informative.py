"""Which tasks inform: the full cache must beat the best constant answer by more than the samples' noise."""

from __future__ import annotations

import pandas as pd
import pytest

from ripplekv.analysis.informative import counted_tasks, informative_tasks, trivial_answer


def lines(task: str, predictions: list[str], answers: list[list[str]], scores: list[float]) -> list[dict]:
    return [{"task": task, "id": f"{task}-{i}", "method": "full", "budget": None, "prediction": p, "answers": a,
             "score": s} for i, (p, a, s) in enumerate(zip(predictions, answers, scores))]


def test_the_trivial_answer_is_the_best_constant_among_predictions_and_answers():
    # Retrieval: naming paragraph 1 every time is right on the 2 samples whose answer it is ("1" and "Paragraph 1"
    # read the same to the metric; the most frequent candidate comes first).
    answers = [["Paragraph 1"], ["Paragraph 1"], ["Paragraph 2"], ["Paragraph 3"]]
    answer, scores = trivial_answer("passage_retrieval", answers, ["1", "1", "1", "2"])
    assert answer == "1" and scores.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_a_task_informs_only_when_the_full_cache_clearly_beats_the_constant():
    needles = [f"{7000 + i}" for i in range(8)]
    frame = pd.DataFrame(
        # niah: the full cache finds 7 of 8 distinct needles; a constant finds at most one -> informative.
        lines("niah", needles[:7] + ["nothing"], [[n] for n in needles], [1.0] * 7 + [0.0])
        # retrieval: the full cache always says "Paragraph 1" (right twice); "Paragraph 2" every time would be right
        # six times -> far from informative.
        + lines("passage_retrieval", ["Paragraph 1"] * 8, [["Paragraph 1"]] * 2 + [["Paragraph 2"]] * 6,
                [1.0] * 2 + [0.0] * 6)
        # squad with one sample: no interval -> not informative.
        + lines("squad", ["yes"], [["yes"]], [1.0])
    )
    table = informative_tasks(frame).set_index("task")
    niah, retrieval, squad = table.loc["niah"], table.loc["passage_retrieval"], table.loc["squad"]
    assert niah.informative and niah.full_score == 87.5 and niah.trivial_score == 12.5 and niah.margin_low > 0
    assert niah.margin == pytest.approx(75.0)
    assert not retrieval.informative and retrieval.trivial_answer == "Paragraph 2" and retrieval.margin == pytest.approx(-50)
    assert not squad.informative and squad.samples == 1
    assert counted_tasks(informative_tasks(frame)) == ["niah"]


def test_a_margin_within_the_noise_is_not_informative():
    # 3 of 6 distinct answers found against a constant's 1 of 6: margin 2/6 = 33 points, but the one-sided
    # lower bound at n = 6 (t 2.015 x sd 0.516 / sqrt 6 = 0.42) is below 0.
    answers = [[f"{100 + i}"] for i in range(6)]
    frame = pd.DataFrame(lines("niah", ["100", "101", "102", "x", "y", "z"], answers, [1, 1, 1, 0, 0, 0]))
    row = informative_tasks(frame).iloc[0]
    assert row.margin == pytest.approx(100 * 2 / 6) and row.margin_low < 0 and not row.informative


def test_lines_without_predictions_get_no_verdict_and_every_task_counts():
    frame = pd.DataFrame([{"task": t, "id": f"{t}-{i}", "method": "full", "budget": None, "score": 1.0}
                          for t in ("niah", "squad") for i in range(3)])
    table = informative_tasks(frame)
    assert table["informative"].isna().all() and counted_tasks(table) == ["niah", "squad"]
