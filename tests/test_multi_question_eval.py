"""`eval --protocol multi-question`: the offline tasks with several questions, SCBench's loader, the eval's lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from ripplekv.errors import UserError
from ripplekv.tasks import get_tasks, load_samples
from ripplekv.tasks.prompts import prompt_length
from ripplekv.tasks.registry import multi_question_tasks

TARGET = 1000
NEEDLE = re.compile(r"The special magic number for ([a-z]+-[a-z]+) is: (\d{7})\.")
LAYERS, KV_HEADS = 4, 2


@pytest.fixture(scope="module")
def built(tokenizer):
    return {(task.name, split): load_samples(task, tokenizer, split=split, limit=4, target_tokens=TARGET)
            for task in multi_question_tasks("offline") for split in ("eval", "calibration")}


def test_offline_tasks_ask_each_context_several_questions_whose_answers_it_holds(built, tokenizer):
    for (name, _), records in built.items():
        (task,) = get_tasks("offline", [name])
        assert task.multi_question and len(records) == 4
        for record in records:
            asked = record["questions"]
            assert len(asked) == 3 and asked[0] == {"input": record["input"], "answers": record["answers"]}
            assert len({one["input"] for one in asked}) == 3  # three different questions
            for one in asked:
                assert any(answer in record["context"] for answer in one["answers"])
            assert abs(prompt_length(task, record, tokenizer) - TARGET) <= 0.05 * TARGET
            if name == "niah_multiquestion":  # each asked needle is in the haystack once
                needles = dict(NEEDLE.findall(record["context"]))
                assert len(needles) == 3 and sorted(needles.values()) == sorted(a["answers"][0] for a in asked)


def test_offline_multi_question_tasks_are_deterministic_with_disjoint_calibration(built, tokenizer):
    for name in ("niah_multiquestion", "squad_multiquestion"):
        (task,) = get_tasks("offline", [name])
        assert load_samples(task, tokenizer, limit=4, target_tokens=TARGET) == built[(name, "eval")]
        answers = {split: {a for r in built[(name, split)] for q in r["questions"] for a in q["answers"]}
                   for split in ("eval", "calibration")}
        questions = {split: {q["input"] for r in built[(name, split)] for q in r["questions"]}
                     for split in ("eval", "calibration")}
        assert not questions["eval"] & questions["calibration"]
        if name == "niah_multiquestion":
            assert not answers["eval"] & answers["calibration"]


def test_multi_question_tasks_are_chosen_by_the_protocol_and_single_ones_refused():
    assert [t.name for t in multi_question_tasks("offline")] == ["niah_multiquestion", "squad_multiquestion"]
    assert "niah_multiquestion" not in [t.name for t in get_tasks("offline")]  # not in the default list
    with pytest.raises(UserError, match="niah ask.*one question per context.*niah_multiquestion"):
        multi_question_tasks("offline", ["niah"])
    with pytest.raises(UserError, match="no task with several questions"):
        multi_question_tasks("longbench")
    assert all(t.multi_question for t in multi_question_tasks("scbench"))


# --------------------------------------------------------------------------- SCBench's format


def scbench_rows(count: int = 2) -> list[dict]:
    """Records as SCBench writes them: an int id, one context, the turns with input and answer."""
    return [{"id": i, "context": f"Key alpha{i} holds value {1000 + i}. Key beta{i} holds value {2000 + i}. " * 3,
             "multi_turns": [{"input": f"What value does key alpha{i} hold?", "answer": str(1000 + i)},
                             {"input": f"What value does key beta{i} hold?", "answer": str(2000 + i)}]}
            for i in range(count)]


def test_scbench_records_load_through_datasets_from_jsonl_and_parquet(tmp_path, tiny_model_dir, run_cli):
    pytest.importorskip("datasets")
    from ripplekv.tasks import scbench

    (tmp_path / "scbench_kv.jsonl").write_text("".join(json.dumps(row) + "\n" for row in scbench_rows()))
    choice = [{"id": 7, "context": "A story.", "multi_turns": [
        {"input": "Who?", "answer": "Ann", "options": ["Ann", "Bob"]},
        {"input": "Where?", "answer": "Home", "options": ["Home", "Sea"]}]}]
    (tmp_path / "scbench_choice_eng").mkdir()
    pd.DataFrame(choice).to_parquet(tmp_path / "scbench_choice_eng" / "test-00000-of-00001.parquet")
    records = scbench.read_records("scbench_kv", str(tmp_path))
    assert [r["_id"] for r in records] == ["scbench_kv-0", "scbench_kv-1"]
    first = records[0]
    assert first["input"] == "What value does key alpha0 hold?" and first["answers"] == ["1000"]
    assert first["questions"] == [{"input": "What value does key alpha0 hold?", "answers": ["1000"]},
                                  {"input": "What value does key beta0 hold?", "answers": ["2000"]}]
    (picked,) = scbench.read_records("scbench_choice_eng", str(tmp_path))
    assert picked["questions"][1] == {"input": "Where?\nOptions:\n(A) Home\n(B) Sea", "answers": ["Home"]}
    (task,) = get_tasks("scbench", ["scbench_kv"])
    assert load_samples(task, None, data_dir=str(tmp_path), limit=1) == records[:1]
    with pytest.raises(UserError, match="scbench_vt not found in"):
        scbench.read_records("scbench_vt", str(tmp_path))
    from ripplekv.tasks.registry import task_rows

    sizes = {row["task"]: row["size"] for row in task_rows("scbench", str(tmp_path))}
    assert sizes["scbench_kv"] == "local, multi-question" and sizes["scbench_vt"] == "not on disk, multi-question"
    out = tmp_path / "run"  # the suite through eval: each record's context compressed once, both turns asked
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "scbench", "--data-dir", str(tmp_path),
                           "--tasks", "scbench_kv", "--protocol", "multi-question", "--methods", "snapkv",
                           "--budget", "16", "--out", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 and {r["context_id"] for r in rows} == {"scbench_kv-0", "scbench_kv-1"}
    (tmp_path / "scbench_kv.jsonl").write_text(json.dumps({"id": 1, "context": "x", "multi_turns": []}) + "\n")
    with pytest.raises(UserError, match="'multi_turns' must be a list"):
        scbench.read_records("scbench_kv", str(tmp_path))


# --------------------------------------------------------------------------- eval, end to end


def eval_args(model_dir, out, *extra):
    return ["eval", "--model", str(model_dir), "--suite", "offline", "--protocol", "multi-question",
            "--limit", "2", "--target-tokens", "300", "--methods", "snapkv,streamingllm", "--budget", "32",
            "--batch-size", "4", "--out", str(out), *extra]


def test_eval_writes_a_line_per_question_and_the_drop_table(tiny_model_dir, tmp_path, run_cli, monkeypatch):
    from ripplekv.pipeline import multi_question

    prefills = []
    real = multi_question.prefill
    monkeypatch.setattr(multi_question, "prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    out = tmp_path / "run"
    code, _, err = run_cli(*eval_args(tiny_model_dir, out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    contexts = {(r["task"], r["context_id"]) for r in rows}
    assert len(contexts) == 4 and len(prefills) == 4  # two tasks x two samples, one prefill each
    assert len(rows) == 4 * 3 * (1 + 2)  # per context: three questions x (full + two methods at one budget)
    for row in rows:
        assert row["protocol"] == "multi-question" and row["id"] == f"{row['context_id']}#q{row['question_index']}"
        assert row["turn"] == ("first" if row["question_index"] == 1 else "follow-up")
        assert row["compressed_tokens"] < row["prompt_tokens"]  # every question is read after the compressed context
        if row["method"] != "full":
            assert row["kept_entries"] == LAYERS * KV_HEADS * 32
    table = pd.read_csv(out / "follow_ups.csv")
    assert set(zip(table["method"], table["budget"].fillna(0))) == {("full", 0), ("snapkv", 32), ("streamingllm", 32)}
    assert (table["n"] == 4).all() and "Follow-up questions" in (out / "summary.md").read_text()
    code, _, err = run_cli(*eval_args(tiny_model_dir, out))
    assert code == 0 and "already done" in err and len(prefills) == 4  # resumed: nothing run again
    code, _, err = run_cli(*eval_args(tiny_model_dir, out, "--budget", "48"))  # grows: one more budget
    assert code == 0, err
    grown = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(grown) == len(rows) + 4 * 3 * 2 and len(prefills) == 8
    old = {(r["id"], r["method"], r["budget"]): r["prediction"] for r in rows}
    assert all(old[key] == r["prediction"] for r in grown if (key := (r["id"], r["method"], r["budget"])) in old)


def test_question_agnostic_answers_are_the_context_only_answers_of_each_question(tiny_model_dir, tokenizer):
    """Asking the one compressed context each question gives, line for line, what context-only gives for a sample
    holding that question alone (the same context compressed the same way), and multi-question-first's first
    question is with-question's."""
    from ripplekv.engine.models import load_model
    from ripplekv.methods.core.catalog import build_methods
    from ripplekv.pipeline.evaluate import SampleSettings, evaluate_sample

    model, _, _ = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    (task,) = get_tasks("offline", ["squad_multiquestion"])
    (record,) = load_samples(task, tokenizer, limit=1, target_tokens=300)
    methods = build_methods(("snapkv", "streamingllm"), {"allocation": None, "route": None})
    settings = {protocol: SampleSettings(batch_size=4, protocol=protocol) for protocol in
                ("multi-question", "multi-question-first", "context-only", "with-question")}
    asked = evaluate_sample(model, tokenizer, task, record, methods, (32,), settings["multi-question"], sid="s")
    first = evaluate_sample(model, tokenizer, task, record, methods, (32,), settings["multi-question-first"], sid="s")
    keys = ("method", "budget", "prediction", "score", "kept_entries", "prompt_tokens", "compressed_tokens")
    for index, question in enumerate(record["questions"], 1):
        alone = {**{k: v for k, v in record.items() if k != "questions"}, **question}
        expected = evaluate_sample(model, tokenizer, task, alone, methods, (32,), settings["context-only"], sid="x")
        got = [row for row in asked if row["question_index"] == index]
        assert [[row[k] for k in keys] for row in got] == [[row[k] for k in keys] for row in expected]
        assert [row["kl"] for row in got] == pytest.approx([row["kl"] for row in expected], abs=1e-6)
    with_question = evaluate_sample(model, tokenizer, task, record, methods, (32,), settings["with-question"], sid="s")
    opening = [row for row in first if row["question_index"] == 1]
    assert [[row[k] for k in keys] for row in opening] == [[row[k] for k in keys] for row in with_question]
    later = [row for row in first if row["question_index"] > 1]
    assert all(row["compressed_tokens"] == with_question[0]["prompt_tokens"] for row in later)


def test_mistakes_end_in_one_line(tiny_model_dir, tmp_path, run_cli):
    code, _, err = run_cli(*eval_args(tiny_model_dir, tmp_path / "a", "--tasks", "niah"))
    assert code == 2 and "niah ask(s) one question per context" in err
    code, _, err = run_cli(*eval_args(tiny_model_dir, tmp_path / "b", "--methods", "oracle"))
    assert code == 2 and "oracle read(s) the full cache's answer" in err
    code, _, err = run_cli(*eval_args(tiny_model_dir, tmp_path / "c", "--decode-budget", "total"))
    assert code == 2 and "with-question only" in err
    assert not any((tmp_path / name).exists() for name in "abc")


def test_the_kvpress_parity_script_lays_prompts_out_as_kvpress_and_counts_same_answers(tokenizer, tmp_path, monkeypatch,
                                                                                       capsys):
    from tests.conftest import load_script, script_refusal

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    parity = load_script("check_references_questions")
    context, questions = parity.kvpress_layout(tokenizer, "The cat is Tom.", ["Who is the cat?", "What?"])
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "The cat is Tom.Who is the cat?"}],
                                          add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(context + questions[0]) == whole  # the context, then a question closing the user turn
    assert tokenizer.decode(context).endswith("The cat is Tom.") and len(questions) == 2
    ours = {spec: {64: [["Tom", "x"]]} for spec in parity.PRESSES}
    theirs = {name: {"64": [["Tom ", "y"]]} for name in parity.PRESSES.values()}
    lines = parity.compare(ours, theirs, ours)
    assert [ok for _, ok, _ in lines] == [False] * len(parity.PRESSES) and "identical answers 0.5000 of 2" in lines[0][2]
    tied = {spec: {64: [["Tom", "y"]]} for spec in parity.PRESSES}  # kvpress's tie order gives its answers
    lines = parity.compare(ours, theirs, tied)
    assert all(ok for _, ok, _ in lines) and "0.5000 of 2 (prompt, question, budget); with kvpress's tie order 1.0000" in lines[0][2]
    err = script_refusal("check_references_questions", "--budgets", "16", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert err.startswith("error: --budgets must exceed the window") and not any(tmp_path.iterdir())


def test_the_parity_scripts_kvpress_tie_order_keeps_what_torch_topk_keeps(monkeypatch):
    """The parity's second pass keeps, among scores tied at the cut, torch.topk's entries in every selection (also
    where a method imported the selection by name), and only the tie order changes."""
    import sys

    import torch

    from ripplekv.methods.core import base, selection
    from tests.conftest import load_script

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    parity = load_script("check_references_questions")
    selections = (selection.top_mask, selection.top_indices)
    bound = {(name, attribute): value for name, module in list(sys.modules.items()) if name.startswith("ripplekv")
             for attribute, value in vars(module).items() if any(value is one for one in selections)}
    original_mask, original_indices = selection.top_mask, selection.top_indices
    scores = torch.tensor([[0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, -3.0]])
    try:
        parity.kvpress_ties()
        expected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, torch.topk(scores, 3).indices, True)
        assert torch.equal(selection.top_mask(scores, 3), expected)
        assert torch.equal(selection.top_indices(scores, 3), torch.topk(scores, 3).indices)
        assert base.top_indices is selection.top_indices  # a name imported elsewhere is rebound too
        assert torch.equal(base.top_scored_mask(scores, 8, 0, 3), expected)  # which reads selection's top_mask
        assert torch.equal(selection.top_mask(scores, 1), original_mask(scores, 1))  # no tie at the cut: same set
    finally:
        for (name, attribute), value in bound.items():
            setattr(sys.modules[name], attribute, value)
    assert selection.top_mask is original_mask and selection.top_indices is original_indices
