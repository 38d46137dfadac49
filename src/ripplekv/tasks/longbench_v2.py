"""LongBench v2: 503 multiple-choice questions over 8k-2M-word contexts, read from the official `data.json`.

Sources, first found wins (as LongBench v1's files, `tasks.longbench`):
1. `data.json` given as the path itself, or inside the folder (`--data-dir`, else $RIPPLEKV_LONGBENCH_DIR, else
   `<ripplekv cache>/longbench`: v1's jsonl files and v2's data.json can share one folder);
2. the hub copy `THUDM/LongBench-v2` (split `train`) through `datasets` (the `hub` extra), only when no folder
   was named, so a wrong --data-dir fails at once instead of starting a download.

The prompt is the benchmark's zero-shot template (its `prompts/0shot.txt`: context, question and the four
choices, each stripped); generation is 128 tokens; the answer is read as the official `pred.py` reads it
("The correct answer is (X)", or without the brackets, after removing `*`), and accuracy is reported
overall and by difficulty and length class (`ripplekv score`). Middle truncation to the model's window is
LongBench's, shared with v1 (`tasks.prompts`). The template's text is LongBench's (MIT licence, beside
the v1 tables in `ripplekv/data/longbench/`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ripplekv.errors import UserError

SUITE = "longbench-v2"
TASK = "longbench_v2"
CATEGORY = "Multiple Choice"
METRIC = "choice_accuracy"
MAX_NEW_TOKENS = 128  # pred.py's max_new_tokens without chain of thought
HUB_ID = "THUDM/LongBench-v2"
FILE = "data.json"
OFFICIAL_SIZE = 503
PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n{context}\n</text>\n\n"
    "What is the correct answer to this question: {input}\nChoices:\n(A) {choice_A}\n(B) {choice_B}\n"
    "(C) {choice_C}\n(D) {choice_D}\n\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)
TEXT_FIELDS = ("_id", "domain", "sub_domain", "question", "choice_A", "choice_B", "choice_C", "choice_D", "context")
CLASSES = {"difficulty": ("easy", "hard"), "length": ("short", "medium", "long"), "answer": ("A", "B", "C", "D")}
FIELDS = ("difficulty", "length_class", "domain")  # kept on every prediction line
SCORE_BY = ("difficulty", "length_class")  # the official breakdown


def _file(data_dir: str | None) -> tuple[Path, bool]:
    """Where data.json would be, and whether the user named the place."""
    from ripplekv.tasks.longbench import _configured_dir

    where, explicit = _configured_dir(data_dir)
    return (where if where.suffix == ".json" else where / FILE), explicit


def normalize(item, where: str) -> dict:
    """An official record checked field by field, as a ripplekv record (LongBench fields + the choices)."""
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected a JSON object with the LongBench v2 fields")
    missing = [f for f in (*TEXT_FIELDS, *CLASSES) if f not in item]
    if missing:
        raise UserError(f"{where}: record has no {', '.join(repr(m) for m in missing)}; LongBench v2 records need "
                        f"{', '.join((*TEXT_FIELDS, *CLASSES))}")
    for field in (*TEXT_FIELDS, *CLASSES):
        if not isinstance(item[field], str):
            raise UserError(f"{where}: {field!r} must be a string; replace the file with the official data.json")
    for field, allowed in CLASSES.items():
        if item[field] not in allowed:
            raise UserError(f"{where}: {field!r} is {item[field]!r}, not one of {', '.join(allowed)}")
    context = item["context"].strip()
    return {
        "input": item["question"].strip(),
        "context": context,
        **{f"choice_{c}": item[f"choice_{c}"].strip() for c in "ABCD"},
        "answers": [item["answer"]],
        "length": len(context.split()),
        "length_class": item["length"],
        "difficulty": item["difficulty"],
        "domain": item["domain"],
        "sub_domain": item["sub_domain"],
        "dataset": TASK,
        "language": "en",
        "all_classes": None,
        "_id": item["_id"],
    }


def parse(items, source: str) -> list[dict]:
    """All records of a loaded data.json (a list of objects), ids unique."""
    if not isinstance(items, list):
        raise UserError(f"{source}: expected a JSON list of records (the official data.json)")
    records, seen = [], {}
    for index, item in enumerate(items):
        record = normalize(item, f"{source}: record {index + 1}")
        if record["_id"] in seen:
            raise UserError(f"{source}: record {index + 1} repeats the _id {record['_id']!r} of record "
                            f"{seen[record['_id']]}; every record needs its own _id")
        seen[record["_id"]] = index + 1
        records.append(record)
    return records


def _read_local(path: Path) -> list[dict]:
    try:
        with open(path, encoding="utf-8-sig") as handle:
            items = json.load(handle)
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; replace it with the official LongBench v2 data.json") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); "
                        "replace it with the official LongBench v2 data.json") from None
    except OSError as err:
        raise UserError(f"{path} cannot be read ({err.strerror or err})") from None
    return parse(items, str(path))


def _read_hub() -> list[dict] | None:
    """The hub copy (or the local hub cache) through `datasets`; any failure -> None."""
    from ripplekv.tasks.longbench import _hub_worth_trying

    if not _hub_worth_trying():
        return None
    try:
        import datasets

        data = datasets.load_dataset(HUB_ID, split="train")
        return parse([dict(row) for row in data], HUB_ID)
    except UserError:
        raise
    except Exception:  # no `datasets`, offline and not cached, hub down: all mean "put the file here"
        return None


def read_records(name: str = TASK, data_dir: str | None = None) -> list[dict]:
    """Every record of LongBench v2, in file order."""
    path, explicit = _file(data_dir)
    if path.is_file():
        return _read_local(path)
    if explicit:
        raise UserError(f"LongBench v2 file {path} not found: put the official {FILE} there, or pass another "
                        "--data-dir (a folder holding data.json, or the file itself)")
    records = _read_hub()
    if records is None:
        raise UserError(f"LongBench v2 data not found: put the official {FILE} in {path.parent} or pass --data-dir "
                        f"(the hub copy {HUB_ID} could not be loaded: it needs the `hub` extra, and offline a copy "
                        "already in the HF cache with HF_HUB_OFFLINE=1)")
    return records


def local_record_count(data_dir: str | None = None) -> int | None:
    """Records in the local data.json, None when there is none: counts its `"_id"` keys without parsing the
    whole file (a key cannot occur inside a JSON string, where its quotes would be escaped)."""
    path, _ = _file(data_dir)
    if not path.is_file():
        return None
    count, tail = 0, b""
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            block = tail + chunk
            count += block.count(b'"_id"')
            tail = block[-4:]
    return count
