"""The task registry and prompt building: official tables, chat rule, middle truncation like pred.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ripplekv.data import Task, build_prompt_ids, get_tasks, list_suites
from ripplekv.data.prompts import official_max_new_tokens, official_prompts, prompt_length
from ripplekv.errors import UserError

NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
SHARED = Path(__file__).resolve().parents[1] / "src" / "ripplekv" / "data" / "longbench"


def test_suites_and_sizes():
    assert list_suites() == ["offline", "longbench", "longbench-e"]
    assert len(get_tasks("longbench")) == 21
    e_tasks = get_tasks("longbench-e")
    assert len(e_tasks) == 13 and all(t.name.endswith("_e") for t in e_tasks)
    assert [t.name for t in get_tasks("offline")] == [
        "hotpotqa", "squad", "passage_retrieval", "passage_count", "niah", "niah_multikey", "code_completion",
    ]


def test_official_tables_are_used_verbatim():
    prompts = json.loads((SHARED / "dataset2prompt.json").read_text(encoding="utf-8"))
    maxlen = json.loads((SHARED / "dataset2maxlen.json").read_text(encoding="utf-8"))
    assert official_prompts() == prompts and official_max_new_tokens() == maxlen
    for task in get_tasks("longbench") + get_tasks("longbench-e"):
        assert task.prompt_template == prompts[task.dataset]
        assert task.max_new_tokens == maxlen[task.dataset]


def test_chat_template_rule_per_dataset():
    for task in get_tasks("longbench") + get_tasks("longbench-e"):
        assert task.chat_template is (task.dataset not in NO_CHAT), task.name
    assert {t.name for t in get_tasks("longbench") if not t.chat_template} == NO_CHAT
    assert {t.name for t in get_tasks("longbench-e") if not t.chat_template} == {
        "trec_e", "triviaqa_e", "samsum_e", "lcc_e", "repobench-p_e"}
    offline = {t.name: t for t in get_tasks("offline")}
    assert not offline["code_completion"].chat_template
    assert all(t.chat_template for name, t in offline.items() if name != "code_completion")


def test_stop_at_newline_only_samsum():
    stopping = {t.name for suite in list_suites() for t in get_tasks(suite) if t.stop_at_newline}
    assert stopping == {"samsum", "samsum_e"}


def test_metrics_and_categories_named():
    tasks = {t.name: t for t in get_tasks("longbench")}
    assert tasks["hotpotqa"].metric == "qa_f1" and tasks["hotpotqa"].category == "Multi-Doc QA"
    assert tasks["lcc"].metric == "code_sim" and tasks["lcc"].category == "Code"
    assert tasks["passage_count"].metric == "count" and tasks["passage_retrieval_en"].metric == "retrieval"
    offline = {t.name: t.metric for t in get_tasks("offline")}
    assert offline == {"hotpotqa": "qa_f1", "squad": "qa_f1", "passage_retrieval": "retrieval",
                       "passage_count": "count", "niah": "string_match", "niah_multikey": "string_match",
                       "code_completion": "code_sim"}
    for suite in list_suites():
        for task in get_tasks(suite):
            assert "{context}" in task.prompt_template


def test_get_tasks_by_name_and_alias():
    assert [t.name for t in get_tasks("longbench", ["samsum", "lcc", "samsum"])] == ["samsum", "lcc"]
    assert [t.name for t in get_tasks("longbench-e", ["hotpotqa", "lcc_e"])] == ["hotpotqa_e", "lcc_e"]


def test_unknown_suite_and_task_list_the_known_ones():
    with pytest.raises(UserError, match="known suites: offline, longbench, longbench-e"):
        get_tasks("longbench-v2")
    with pytest.raises(UserError) as err:
        get_tasks("offline", ["niah", "nope"])
    assert "'nope'" in str(err.value) and "niah_multikey" in str(err.value) and "code_completion" in str(err.value)
    with pytest.raises(UserError, match="narrativeqa"):
        get_tasks("longbench", ["narrative"])


def _task(name: str) -> Task:
    return get_tasks("longbench", [name])[0]


def _record(context: str, question: str = "Who wrote it?") -> dict:
    return {"input": question, "context": context, "answers": ["x"], "length": 0, "dataset": "d",
            "language": "en", "all_classes": None, "_id": "r"}


def test_short_prompt_is_not_truncated(tokenizer):
    record = _record("The essay was written by Ada Lovelace in 1843.")
    lcc = _task("lcc")
    prompt = lcc.prompt_template.format(**record)
    assert build_prompt_ids(lcc, record, tokenizer, 4096) == list(tokenizer(prompt).input_ids)
    hotpot = _task("hotpotqa")
    prompt = hotpot.prompt_template.format(**record)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = build_prompt_ids(hotpot, record, tokenizer, 4096)
    assert ids == list(tokenizer(chat, add_special_tokens=False).input_ids)
    assert len(ids) == prompt_length(hotpot, record, tokenizer)
    assert tokenizer.decode(ids).rstrip().endswith("assistant")


def _long_record() -> dict:
    words = " ".join(f"word{i} alpha beta" for i in range(1500))
    return _record("START-OF-CONTEXT " + words + " END-OF-CONTEXT")


@pytest.mark.parametrize("max_length", [200, 301, 1000])
def test_truncation_keeps_first_and_last_halves(tokenizer, max_length):
    task = _task("lcc")  # no chat template: the ids are the truncated prompt itself
    record = _long_record()
    full = tokenizer(task.prompt_template.format(**record), truncation=False).input_ids
    assert len(full) > max_length
    half = max_length // 2
    ids = build_prompt_ids(task, record, tokenizer, max_length)
    assert abs(len(ids) - 2 * half) <= 3  # re-tokenizing the joined halves may merge at the seam
    text = tokenizer.decode(ids)
    head = tokenizer.decode(full[:half], skip_special_tokens=True)
    tail = tokenizer.decode(full[-half:], skip_special_tokens=True)
    assert text == head + tail
    assert text.startswith("Please complete the code given below.")
    assert text.endswith("Next line of code:\n")


def test_truncated_prompt_then_gets_the_chat_template(tokenizer):
    task = _task("hotpotqa")
    record = _long_record()
    ids = build_prompt_ids(task, record, tokenizer, 400)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.rstrip().endswith("<|im_start|>assistant")
    assert "Answer the question based on the given passages" in text and "START-OF-CONTEXT" in text
    assert "END-OF-CONTEXT" in text and "word750 " not in text  # only the middle was cut
    assert "Question: Who wrote it?\nAnswer:" in text
    assert 400 < len(ids) < 400 + 60  # plus the chat template's own tokens


def test_prompt_errors_are_user_errors(tokenizer):
    task = _task("hotpotqa")
    with pytest.raises(UserError, match="at least 2"):
        build_prompt_ids(task, _record("x"), tokenizer, 1)
    with pytest.raises(UserError, match="'context'"):
        build_prompt_ids(task, {"input": "q", "answers": ["a"]}, tokenizer, 100)
