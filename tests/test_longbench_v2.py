"""LongBench v2 from records written in the official data.json format: load, prompt, truncate, extract, score."""

from __future__ import annotations

import json

import pytest

from ripplekv.errors import UserError
from ripplekv.metrics.answers import extract_choice
from ripplekv.metrics.scoring import score_predictions, score_sample
from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples, longbench_v2
from ripplekv.tasks.prompts import format_prompt, question_start


def official(i: int, **over) -> dict:
    """One record with exactly the official fields."""
    record = {
        "_id": f"66f36490821e116aacb2{i:04d}", "domain": "Single-Document QA", "sub_domain": "Literary",
        "difficulty": ("easy", "hard")[i % 2], "length": ("short", "medium", "long")[i % 3],
        "question": f"  Which colour was the door in story {i}? ", "choice_A": " Red", "choice_B": "Blue",
        "choice_C": "Green ", "choice_D": "Ochre {not a placeholder}", "answer": "ABCD"[i % 4],
        "context": f"\n The door in story {i} was painted. " + "Filler words go here. " * 40,
    }
    record.update(over)
    return record


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([official(i) for i in range(6)]), encoding="utf-8")
    return tmp_path


def test_official_records_load_with_their_classes(data_dir):
    (task,) = get_tasks("longbench-v2")
    records = load_samples(task, None, data_dir=str(data_dir))
    assert len(records) == 6 and records[0]["_id"] == "66f36490821e116aacb20000"
    first = records[0]
    assert first["answers"] == ["A"] and first["difficulty"] == "easy" and first["length_class"] == "short"
    assert first["input"] == "Which colour was the door in story 0?" and first["choice_A"] == "Red"
    assert first["context"].startswith("The door in story 0") and first["length"] == len(first["context"].split())
    assert load_samples(task, None, data_dir=str(data_dir / "data.json"), limit=2) == records[:2]  # the file itself
    assert longbench_v2.local_record_count(str(data_dir)) == 6
    assert task.fields == ("difficulty", "length_class", "domain")


def test_the_prompt_is_the_zero_shot_template(data_dir, tokenizer):
    (task,) = get_tasks("longbench-v2")
    record = load_samples(task, None, data_dir=str(data_dir))[1]
    prompt = format_prompt(task, record)
    assert prompt.startswith("Please read the following text and answer the question below.\n\n<text>\nThe door in story 1")
    assert prompt.endswith("What is the correct answer to this question: Which colour was the door in story 1?\n"
                           "Choices:\n(A) Red\n(B) Blue\n(C) Green\n(D) Ochre {not a placeholder}\n\n"
                           'Format your response as follows: "The correct answer is (insert answer here)".')
    ids = build_prompt_ids(task, record, tokenizer, 100_000)
    assert tokenizer.decode(ids).startswith("<|im_start|>system")  # the chat template, one user turn
    cut = question_start(task, record, tokenizer, 100_000)
    assert "What is the correct answer" in tokenizer.decode(ids[cut - 12:cut + 12])


def test_long_contexts_are_cut_in_the_middle(data_dir, tokenizer):
    (task,) = get_tasks("longbench-v2")
    record = load_samples(task, None, data_dir=str(data_dir))[0]
    whole = len(tokenizer(format_prompt(task, record)).input_ids)
    short = tokenizer.decode(build_prompt_ids(task, record, tokenizer, 120))
    assert whole > 120
    assert "Please read the following text" in short and "The correct answer is (insert answer here)" in short
    assert "Filler words go here. " * 30 not in short


@pytest.mark.parametrize("response, choice", [
    ("The correct answer is (B).", "B"), ("**The correct answer is (C)**", "C"), ("The correct answer is D", "D"),
    ("  The correct answer is (A) because", "A"), ("the correct answer is (B)", None), ("(B)", None),
    ("The correct answer is (E)", None), ("The correct answer is (B) or The correct answer is (C)", "B"),
])
def test_answers_are_extracted_as_the_official_script_does(response, choice):
    assert extract_choice(response) == choice
    assert score_sample("longbench_v2", response, ["B"]) == float(choice == "B")


def test_accuracy_by_difficulty_and_length_class(data_dir):
    (task,) = get_tasks("longbench-v2")
    records = load_samples(task, None, data_dir=str(data_dir))
    lines = [{"dataset": "longbench_v2", "pred": f"The correct answer is ({r['answers'][0] if i < 3 else 'A'})",
              "answers": r["answers"], "difficulty": r["difficulty"], "length_class": r["length_class"],
              "all_classes": None, "length": r["length"], "line": i, "method": None, "budget": None}
             for i, r in enumerate(records)]
    table, _ = score_predictions(lines)
    scores = dict(zip(table["dataset"], table["score"]))
    # answers A B C D A B; first three right, then A (wrong, right: record 4's answer is A, wrong)
    right = [True, True, True, False, True, False]
    assert scores["longbench_v2"] == round(100 * sum(right) / 6, 2)
    for value, members in {"easy": [0, 2, 4], "hard": [1, 3, 5], "short": [0, 3], "medium": [1, 4],
                           "long": [2, 5]}.items():
        assert scores[f"longbench_v2@{value}"] == round(100 * sum(right[i] for i in members) / len(members), 2)


@pytest.mark.parametrize("change, message", [
    ({"answer": "E"}, "'answer' is 'E', not one of A, B, C, D"),
    ({"difficulty": "medium"}, "'difficulty' is 'medium'"),
    ({"context": None}, "'context' must be a string"),
])
def test_bad_records_are_one_line(tmp_path, change, message):
    (tmp_path / "data.json").write_text(json.dumps([official(0), official(1, **change)]))
    (task,) = get_tasks("longbench-v2")
    with pytest.raises(UserError, match=f"record 2: {message}"):
        load_samples(task, None, data_dir=str(tmp_path))


def test_missing_fields_repeated_ids_and_missing_files(tmp_path):
    (task,) = get_tasks("longbench-v2")
    bad = official(0)
    del bad["sub_domain"]
    (tmp_path / "data.json").write_text(json.dumps([bad]))
    with pytest.raises(UserError, match="record has no 'sub_domain'"):
        load_samples(task, None, data_dir=str(tmp_path))
    (tmp_path / "data.json").write_text(json.dumps([official(0), official(0)]))
    with pytest.raises(UserError, match="repeats the _id"):
        load_samples(task, None, data_dir=str(tmp_path))
    (tmp_path / "data.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_samples(task, None, data_dir=str(tmp_path))
    with pytest.raises(UserError, match="data.json not found"):
        load_samples(task, None, data_dir=str(tmp_path / "elsewhere"))


def test_without_local_data_or_hub_the_error_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path))
    monkeypatch.delenv("RIPPLEKV_LONGBENCH_DIR", raising=False)
    monkeypatch.setattr(longbench_v2, "_read_hub", lambda: None)
    (task,) = get_tasks("longbench-v2")
    with pytest.raises(UserError, match="LongBench v2 data not found: put the official data.json in"):
        load_samples(task, None)


def test_eval_and_score_on_a_tiny_model(run_cli, tiny_model_dir, data_dir, tmp_path):
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", tiny_model_dir, "--suite", "longbench-v2", "--data-dir", data_dir,
                           "--limit", 2, "--budget", 32, "--methods", "snapkv", "--max-length", 300, "--out", out)
    assert code == 0, err
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["difficulty"] for r in lines} == {"easy", "hard"} and all(r["prompt_tokens"] <= 400 for r in lines)
    code, _, err = run_cli("score", out / "predictions.jsonl", "--out", tmp_path / "scores.csv")
    assert code == 0, err
    rows = (tmp_path / "scores.csv").read_text()
    assert "longbench_v2@easy" in rows and "longbench_v2@short" in rows


def test_a_data_json_with_a_utf8_bom_loads_as_without(data_dir, tmp_path):
    (task,) = get_tasks("longbench-v2")
    marked = tmp_path / "bom"
    marked.mkdir()
    (marked / "data.json").write_bytes(b"\xef\xbb\xbf" + (data_dir / "data.json").read_bytes())
    assert load_samples(task, None, data_dir=str(marked)) == load_samples(task, None, data_dir=str(data_dir))
