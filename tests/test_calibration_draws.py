"""Calibration draws: disjoint shares of the calibration split, each disjoint from the evaluation samples."""

from __future__ import annotations

import pytest

from ripplekv.errors import UserError
from ripplekv.tasks import get_tasks, load_samples
from ripplekv.tasks.calibration import Draw, calibration_prompts

TARGET = 400  # short prompts: the offline suite builds them in well under a second each


def _draws(tokenizer, count: int, draws: int):
    return [calibration_prompts(tokenizer, count, 4, TARGET, draw=Draw(d, draws)) for d in range(draws)]


def test_draws_share_no_sample_with_each_other_or_with_the_evaluation_samples(tokenizer):
    drawn = _draws(tokenizer, 9, 3)
    ids = [{p.sample_id for p in prompts} for prompts in drawn]
    assert all(len(prompts) == 9 for prompts in drawn) and all(len(s) == 9 for s in ids)
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    # Nor the same question, needle or code line (where the answer names what a sample asks; a count or a
    # paragraph number repeats by chance), nor the same prompt tokens.
    named = ("hotpotqa", "squad", "niah", "niah_multikey", "code_completion")
    asked = [{(p.task, tuple(p.answers)) for p in prompts if p.task in named} for prompts in drawn]
    assert not asked[0] & asked[1] and not asked[0] & asked[2] and not asked[1] & asked[2]
    tokens = [{tuple(p.context) for p in prompts} for prompts in drawn]
    assert not tokens[0] & tokens[1] and not tokens[1] & tokens[2]
    evaluated = {r["_id"] for task in get_tasks("offline") for r in load_samples(task, tokenizer, limit=4, target_tokens=TARGET)}
    assert evaluated and not set().union(*ids) & evaluated
    assert all("-calibration-" in sid for sid in set().union(*ids))


def test_stages_of_one_draw_take_prefixes_of_one_sequence_so_they_share_prompts(tokenizer):
    few = calibration_prompts(tokenizer, 4, 4, TARGET, draw=Draw(1, 3))
    more = calibration_prompts(tokenizer, 9, 4, TARGET, draw=Draw(1, 3))
    assert [p.sample_id for p in few] == [p.sample_id for p in more[:4]]
    # Sample i of each task goes to draw i mod 3: draw 1 holds each task's samples 1, 4, 7, ...
    indices = {int(p.sample_id.rsplit("-", 1)[1]) for p in more}
    assert indices == {1, 4} and all(i % 3 == 1 for i in indices)


def test_one_draw_is_the_whole_split_as_before(tokenizer):
    whole = calibration_prompts(tokenizer, 9, 4, TARGET)
    assert [p.sample_id for p in whole] == [p.sample_id for p in calibration_prompts(tokenizer, 9, 4, TARGET, draw=Draw(0, 1))]
    # Round-robin over the tasks, each task's samples in order: the first 7 are sample 0 of each task.
    assert {int(p.sample_id.rsplit("-", 1)[1]) for p in whole[:7]} == {0} and int(whole[7].sample_id[-4:]) == 1
    assert Draw().record() == {} and Draw(2, 3).record() == {"calib_draw": 2, "calib_draws": 3}


@pytest.mark.parametrize("draw, message", [(Draw(3, 3), "--calib-draw must be an integer from 0 to 2"),
                                           (Draw(-1, 2), "--calib-draw must be"), (Draw(0, 0), "--calib-draws must be")])
def test_a_draw_outside_the_draws_is_one_line(tokenizer, draw, message):
    with pytest.raises(UserError, match=message):
        calibration_prompts(tokenizer, 2, 4, TARGET, draw=draw)


def test_a_study_calibrates_on_its_own_tasks_of_any_generated_suite(tokenizer):
    """`SUITE:TASK` names: RULER's calibration split beside the offline suite's, dealt into draws the same way,
    never an evaluation sample; a suite without a calibration split is one line."""
    tasks = ["ruler:vt", "offline:niah", "hotpotqa"]
    drawn = [calibration_prompts(tokenizer, 6, 4, 1024, tasks=tasks, draw=Draw(d, 2)) for d in range(2)]
    assert [p.task for p in drawn[0]] == ["vt", "niah", "hotpotqa"] * 2
    ids = [{p.sample_id for p in prompts} for prompts in drawn]
    assert not ids[0] & ids[1] and all("calibration" in sid for sid in ids[0] | ids[1])
    evaluated = {r["_id"] for task in get_tasks("ruler", ["vt"]) for r in load_samples(task, tokenizer, limit=4,
                                                                                      target_tokens=1024)}
    assert not evaluated & (ids[0] | ids[1])
    with pytest.raises(UserError, match="only the generated suites"):
        calibration_prompts(tokenizer, 2, 4, 600, tasks=["longbench:hotpotqa"])
