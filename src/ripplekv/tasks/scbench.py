"""SCBench's shared-context tasks (arXiv 2412.10319): one long context, several questions, read through `datasets`.

SCBench ships each task as records {id, context, multi_turns: [{input, answer[, options]}, ...]} (the hub's
`microsoft/SCBench`, one config per task, e.g. `scbench_kv`; its repository's `data/` folder as jsonl files named
`multi_turn_<task>.jsonl` in older copies). Sources, first found wins, nothing downloaded at run time:
1. a folder (`--data-dir`, else $RIPPLEKV_SCBENCH_DIR, else `<ripplekv cache>/scbench`) holding `<config>.jsonl`,
   `multi_turn_<task>.jsonl`, or `<config>/*.parquet` (the hub's layout), read with `datasets`' json or parquet
   builder;
2. the hub copy already in the local Hugging Face cache (`datasets.load_dataset("microsoft/SCBench", <config>)`),
   only when no folder was named and the hub answers (offline: HF_HUB_OFFLINE=1 reads the cache).
Each record becomes a multi-question record (`pipeline.multi_question`): the first turn is its LongBench `input`
and `answers`, every turn is in `questions`. The prompt is ripplekv's neutral template (the context, then the
question), not SCBench's own per-task prompts, and the scores are ours (`metrics`): numbers compare methods here,
not with SCBench's published tables. SCBench's contexts run past 100k tokens: `--max-length` cuts them in the middle.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ripplekv.errors import UserError

SUITE = "scbench"
HUB_ID = "microsoft/SCBench"
ENV_DIR = "RIPPLEKV_SCBENCH_DIR"
PROMPT = "Read the text below, then answer the question after it.\n\n{context}\n\n{input}"
# config: (category, metric, max_new_tokens). Tasks whose context is text; their answers are strings or numbers.
TASKS = {
    "scbench_kv": ("String Retrieval", "string_match", 64),
    "scbench_prefix_suffix": ("String Retrieval", "string_match", 64),
    "scbench_vt": ("String Retrieval", "string_match", 64),
    "scbench_repoqa": ("Code", "code_sim", 256),
    "scbench_qa_eng": ("Semantic Retrieval", "qa_f1", 64),
    "scbench_choice_eng": ("Semantic Retrieval", "string_match", 64),
    "scbench_many_shot": ("Global Information", "string_match", 32),
    "scbench_summary": ("Global Information", "rouge", 256),
}


def task_names() -> list[str]:
    return list(TASKS)


def _configured_dir(data_dir: str | None) -> tuple[Path, bool]:
    """The folder to search and whether the user named it."""
    if data_dir:
        return Path(data_dir).expanduser(), True
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser(), True
    from ripplekv.engine.models import cache_root

    return cache_root() / "scbench", False


def find_local(name: str, where: Path) -> tuple[str, list[str]] | None:
    """(`datasets` builder, files) holding task `name` in folder `where`, or None."""
    short = name.removeprefix("scbench_")
    if not where.is_dir():
        return None
    for stem in (name, f"multi_turn_{short}"):
        for candidate in (where / f"{stem}.jsonl", where / "data" / f"{stem}.jsonl"):
            if candidate.is_file():
                return "json", [str(candidate)]
        parquet = sorted((where / stem).glob("*.parquet")) if (where / stem).is_dir() else []
        if parquet:
            return "parquet", [str(path) for path in parquet]
    return None


def _load_files(builder: str, files: list[str]) -> list[dict]:
    """Rows of local files through `datasets` (its cache in a temporary folder: the files are the data)."""
    try:
        import datasets
    except ImportError:
        raise UserError("reading SCBench needs the `datasets` package: pip install 'ripplekv[hub]'") from None
    with tempfile.TemporaryDirectory(prefix="ripplekv-scbench-") as cache:
        try:
            data = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache)
        except Exception as err:  # a broken file: name it, in one line
            raise UserError(f"{files[0]} cannot be read as SCBench {builder} ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); replace it with SCBench's file") from None
        return [dict(row) for row in data]


def _read_hub(name: str) -> list[dict] | None:
    """The hub copy (from the local HF cache when offline); any failure -> None."""
    from ripplekv.tasks.longbench import _hub_worth_trying

    if not _hub_worth_trying():
        return None
    try:
        import datasets

        for split in ("test", "train"):  # the card renamed its split; older caches hold `train`
            try:
                return [dict(row) for row in datasets.load_dataset(HUB_ID, name, split=split)]
            except ValueError:
                continue
    except Exception:  # no `datasets`, offline and not cached, hub down: all mean "put the files here"
        return None
    return None


def _answers(value, where: str) -> list[str]:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, list) and value and all(isinstance(a, (str, int, float)) for a in value):
        return [str(a) for a in value]
    raise UserError(f"{where}: 'answer' must be text, a number or a list of them; replace the file with SCBench's")


def normalize(row: dict, name: str, where: str) -> dict:
    """An SCBench record checked field by field, as a multi-question ripplekv record."""
    if not isinstance(row.get("context"), str):
        raise UserError(f"{where}: 'context' must be text (SCBench records need id, context and multi_turns)")
    turns = row.get("multi_turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "input" in t and "answer" in t
                                                             for t in turns):
        raise UserError(f"{where}: 'multi_turns' must be a list of {{input, answer}} turns")
    questions = []
    for number, turn in enumerate(turns, 1):
        text = str(turn["input"]).strip()
        options = turn.get("options")
        if options:  # multiple choice: the options follow the question
            text += "\nOptions:\n" + "\n".join(f"({chr(65 + k)}) {option}" for k, option in enumerate(options))
        questions.append({"input": text, "answers": _answers(turn["answer"], f"{where} turn {number}")})
    sid = row.get("id")
    return {"input": questions[0]["input"], "context": row["context"], "answers": questions[0]["answers"],
            "questions": questions, "length": len(row["context"].split()), "dataset": name, "language": "en",
            "all_classes": None, "_id": f"{name}-{sid if sid is not None else where.rsplit(' ', 1)[-1]}"}


def parse(rows: list[dict], name: str, source: str) -> list[dict]:
    """Every record of one task, ids unique."""
    records, seen = [], {}
    for index, row in enumerate(rows, 1):
        record = normalize(row, name, f"{source} record {index}")
        if record["_id"] in seen:
            raise UserError(f"{source}: record {index} repeats the id of record {seen[record['_id']]}; every "
                            "record needs its own id")
        seen[record["_id"]] = index
        records.append(record)
    return records


def read_records(name: str, data_dir: str | None = None) -> list[dict]:
    """Every record of SCBench task `name` (e.g. `scbench_kv`), in file order."""
    where, explicit = _configured_dir(data_dir)
    found = find_local(name, where)
    if found is not None:
        builder, files = found
        return parse(_load_files(builder, files), name, files[0])
    short = name.removeprefix("scbench_")
    if explicit:
        raise UserError(f"SCBench task {name} not found in {where}: put {name}.jsonl (or multi_turn_{short}.jsonl, "
                        f"or the hub's {name}/*.parquet) there, or pass another --data-dir")
    rows = _read_hub(name)
    if rows is None:
        raise UserError(f"SCBench data not found: put {name}.jsonl (or the hub's {name}/*.parquet) in {where} or pass "
                        f"--data-dir (the hub copy {HUB_ID} could not be loaded; one already in the HF cache loads "
                        "with HF_HUB_OFFLINE=1)")
    return parse(rows, name, f"{HUB_ID}/{name}")


def is_local(name: str, data_dir: str | None = None) -> bool:
    """Whether task `name`'s files are where ripplekv looks (no network)."""
    return find_local(name, _configured_dir(data_dir)[0]) is not None
