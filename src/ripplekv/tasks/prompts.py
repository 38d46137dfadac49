"""Prompt templates and prompt -> token ids, exactly as LongBench's official `pred.py` does it.

The official tables (`dataset2prompt.json`, `dataset2maxlen.json`) ship inside the package and are
read with importlib.resources, so they work from a wheel as well as from a source checkout.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from ripplekv.errors import UserError

# pred.py builds no chat prompt for these: "chat models are better off without build prompts on these tasks".
NO_CHAT_DATASETS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
# pred.py stops samsum at the first newline (the model otherwise repeats "\nDialogue" forever).
STOP_AT_NEWLINE_DATASETS = ("samsum",)


@cache
def _official_table(name: str) -> dict:
    text = resources.files("ripplekv.data").joinpath("longbench", name).read_text(encoding="utf-8")
    return json.loads(text)


def official_prompts() -> dict[str, str]:
    """LongBench v1 prompt template per dataset (keys: the 21 dataset names)."""
    return dict(_official_table("dataset2prompt.json"))


def official_max_new_tokens() -> dict[str, int]:
    """LongBench v1 generation length per dataset."""
    return dict(_official_table("dataset2maxlen.json"))


# Offline suite templates: LongBench's wording where the task is the same, adapted where LongBench's
# text would be false here (our paragraphs come from essays, not Wikipedia; the count of paragraphs varies).
# hotpotqa, squad and code_completion borrow LongBench's own templates unchanged (squad takes the
# single-document QA prompt of multifieldqa_en).
OFFLINE_BORROWED = {"hotpotqa": "hotpotqa", "squad": "multifieldqa_en", "squad_multiquestion": "multifieldqa_en",
                    "code_completion": "lcc"}
OFFLINE_PROMPTS = {
    "passage_retrieval": (
        "Here are some paragraphs from essays, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be "
        'like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_count": (
        "There are some paragraphs below sourced from essays. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "niah": (
        "A long text follows. Somewhere inside it are special magic numbers; read carefully, you will be "
        "asked for one of them.\n\n{context}\n\n{input} Only give the number and do not output any other "
        "words.\nAnswer:"
    ),
}
OFFLINE_PROMPTS["niah_multikey"] = OFFLINE_PROMPTS["niah_multiquestion"] = OFFLINE_PROMPTS["niah"]
OFFLINE_PROMPTS["paragraph_recall"] = (
    "Below are paragraphs from essays. After them you are given the first words of one paragraph; repeat "
    "that whole paragraph exactly, word for word, from its first word to its last.\n\n{context}\n\n"
    'The paragraph begins: "{input}"\n\nRepeat the whole paragraph:'
)


def offline_prompt(name: str) -> str:
    """Template of an offline task; borrowed ones come from the official table at call time."""
    if name in OFFLINE_BORROWED:
        return official_prompts()[OFFLINE_BORROWED[name]]
    return OFFLINE_PROMPTS[name]


def format_prompt(task, record: dict) -> str:
    """`template.format(**record)`, as pred.py; a record missing a field is a user-data problem."""
    try:
        return task.prompt_template.format(**record)
    except KeyError as err:
        raise UserError(f"record {record.get('_id', '?')} of {task.name} has no field {err}; "
                        "records need the LongBench fields 'context' and 'input'") from None


def answer_prefix(task, record: dict) -> str:
    """What the model reads after the prompt (and after the chat template's assistant turn): RULER's answer
    prefix for tasks whose records carry one, else nothing."""
    return record.get("answer_prefix", "") if task.answer_prefix else ""


def _final_text(task, prompt: str, tokenizer, prefix: str = "") -> tuple[str, bool]:
    """The text the model reads and whether the tokenizer adds its special tokens to it.

    Wrapped in the chat template (one user turn) unless the task says not to, then `prefix` (the answer's
    start, RULER's answer prefix) after it. The chat template text already holds any BOS the model wants,
    so it is tokenized without adding special tokens again; a tokenizer without a chat template gets the
    plain prompt (pred.py does the same for base models).
    """
    if task.chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return text + prefix, False
    return prompt + prefix, True


def _final_ids(task, prompt: str, tokenizer, prefix: str = "") -> list[int]:
    text, special = _final_text(task, prompt, tokenizer, prefix)
    return list(tokenizer(text, add_special_tokens=special, truncation=False).input_ids)


def _middle_truncated(task, record: dict, tokenizer, max_length: int) -> str:
    if max_length < 2:
        raise UserError(f"max length must be at least 2 tokens, got {max_length}")
    prompt = format_prompt(task, record)
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) > max_length:
        half = int(max_length / 2)
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[-half:], skip_special_tokens=True
        )
    return prompt


def question_start(task, record: dict, tokenizer, max_length: int) -> int:
    """Token index where the part of the prompt after the context (the question, the instructions that
    follow it and the chat template's closing) begins: the boundary of the context-only protocol.

    Found by locating the template's text after `{context}` in the final text and mapping that
    character offset to a token with the fast tokenizer's offsets (the prompt itself is unchanged).
    """
    text, special = _final_text(task, _middle_truncated(task, record, tokenizer, max_length), tokenizer,
                                answer_prefix(task, record))
    template = task.prompt_template
    tail = template.split("{context}", 1)[1] if "{context}" in template else ""
    try:
        tail_text = tail.format(**{k: v for k, v in record.items() if isinstance(k, str)})
    except (KeyError, IndexError, ValueError):
        tail_text = ""
    encoded = tokenizer(text, add_special_tokens=special, truncation=False, return_offsets_mapping=True)
    ids, offsets = encoded.input_ids, encoded.offset_mapping
    cut = text.rfind(tail_text) if tail_text.strip() else -1
    if cut < 0:
        return len(ids)
    for index, (start, end) in enumerate(offsets):
        if end > cut and end > start:
            return index
    return len(ids)


def build_prompt_ids(task, record: dict, tokenizer, max_length: int) -> list[int]:
    """The model's input ids for one record, following the official pred.py step by step.

    1. prompt = template.format(**record)
    2. ids = tokenizer(prompt, truncation=False).input_ids (special tokens included, as pred.py)
    3. if len(ids) > max_length: keep the first and last max_length//2 ids, decode each half with
       skip_special_tokens=True and join the two strings (truncation in the middle keeps the
       instructions at both ends)
    4. apply the chat template unless task.chat_template is False, add the answer prefix (RULER), and
       tokenize the result.
    """
    prompt = _middle_truncated(task, record, tokenizer, max_length)
    return _final_ids(task, prompt, tokenizer, answer_prefix(task, record))


def prompt_length(task, record: dict, tokenizer) -> int:
    """Untruncated prompt length in tokens, chat template included (what the model would read)."""
    return len(_final_ids(task, format_prompt(task, record), tokenizer, answer_prefix(task, record)))
