"""The task registry and prompt building: official tables, chat rule, middle truncation like pred.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ripplekv.errors import UserError
from ripplekv.tasks import Task, build_prompt_ids, get_tasks, list_suites
from ripplekv.tasks.prompts import official_max_new_tokens, official_prompts, prompt_length

NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
# The official tables as handed to the project (beside the checkout in CI); the package ships a copy.
OFFICIAL = Path(__file__).resolve().parents[2] / "shared" / "longbench"
# Facts from LongBench's dataset2maxlen.json, written out so the check works in any clone.
OFFICIAL_MAXLEN = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
                   "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512,
                   "multi_news": 512, "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
                   "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64,
                   "repobench-p": 64}


def test_suites_and_sizes():
    assert list_suites() == ["offline", "ruler", "longbench", "longbench-e", "longbench-v2", "scbench"]
    assert len(get_tasks("ruler")) == 13 and [t.name for t in get_tasks("longbench-v2")] == ["longbench_v2"]
    assert len(get_tasks("longbench")) == 21
    e_tasks = get_tasks("longbench-e")
    assert len(e_tasks) == 13 and all(t.name.endswith("_e") for t in e_tasks)
    assert [t.name for t in get_tasks("offline")] == [
        "hotpotqa", "squad", "passage_retrieval", "passage_count", "niah", "niah_multikey", "code_completion",
    ]


def test_official_tables_are_used_verbatim():
    prompts, maxlen = official_prompts(), official_max_new_tokens()
    assert maxlen == OFFICIAL_MAXLEN
    assert prompts["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert len(prompts) == 21 and all("{context}" in p for p in prompts.values())
    if OFFICIAL.is_dir():  # the copy handed to the project, when it sits beside the checkout
        assert prompts == json.loads((OFFICIAL / "dataset2prompt.json").read_text(encoding="utf-8"))
        assert maxlen == json.loads((OFFICIAL / "dataset2maxlen.json").read_text(encoding="utf-8"))
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
    with pytest.raises(UserError, match="known suites: offline, ruler, longbench, longbench-e, longbench-v2"):
        get_tasks("longbench-v3")
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
