"""Read the real LongBench v1 / LongBench-E test sets.

Sources, first found wins:
1. a folder of the official jsonl files (`<name>.jsonl`, or `data/<name>.jsonl` as data.zip unpacks),
2. the official `data.zip` (members `data/<name>.jsonl`), inside the folder or given as the path itself,
3. the Hugging Face hub copy `THUDM/LongBench` (Parquet) through `datasets` — only when no folder
   was named, so a wrong --data-dir fails at once instead of starting a download.
The folder is `data_dir`, else $RIPPLEKV_LONGBENCH_DIR, else `<ripplekv cache>/longbench`.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path

from ripplekv.errors import UserError

HUB_ID = "THUDM/LongBench"
ENV_DIR = "RIPPLEKV_LONGBENCH_DIR"
REQUIRED_FIELDS = ("input", "context", "answers")

# Published test-set sizes (LongBench task.md): shown by `ripplekv tasks` when no local copy exists.
OFFICIAL_SIZES = {name: 200 for name in (
    "narrativeqa", "qasper", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique", "dureader",
    "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh",
)}
OFFICIAL_SIZES.update({"multifieldqa_en": 150, "lcc": 500, "repobench-p": 500})
OFFICIAL_SIZES.update({name + "_e": 300 for name in (
    "hotpotqa", "2wikimqa", "gov_report", "trec", "triviaqa", "samsum", "passage_count",
    "passage_retrieval_en", "lcc", "repobench-p",
)})
OFFICIAL_SIZES.update({"qasper_e": 224, "multifieldqa_en_e": 150, "multi_news_e": 294})


def default_dir() -> Path:
    """Where ripplekv looks when no folder is named: <ripplekv cache>/longbench."""
    from ripplekv.engine.models import cache_root

    return cache_root() / "longbench"


def _configured_dir(data_dir: str | None) -> tuple[Path, bool]:
    """The folder (or zip) to search and whether the user named it explicitly."""
    if data_dir:
        return Path(data_dir).expanduser(), True
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser(), True
    return default_dir(), False


def _find_local(name: str, where: Path) -> tuple[str, Path, str] | None:
    """('jsonl', path, '') or ('zip', zip_path, member) for dataset `name`, or None."""
    if where.is_dir():
        for candidate in (where / f"{name}.jsonl", where / "data" / f"{name}.jsonl"):
            if candidate.is_file():
                return "jsonl", candidate, ""
        zip_path = where / "data.zip"
    else:
        zip_path = where
    if zip_path.is_file() and zipfile.is_zipfile(zip_path):
        with _reading(str(zip_path)), zipfile.ZipFile(zip_path) as archive:
            members = set(archive.namelist())
        for member in (f"data/{name}.jsonl", f"{name}.jsonl"):
            if member in members:
                return "zip", zip_path, member
    return None


# The datasets scored by classification, which reads each record's `all_classes` (registry.LONGBENCH_DATASETS).
CLASSIFIED = ("trec", "lsht")


def _parse_jsonl(lines, source: str, name: str) -> list[dict]:
    """Parse official jsonl lines; a broken line or a record without answers names file and line."""
    records, first_line = [], {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{source}: line {lineno} is not valid JSON ({err.msg}); "
                            "replace the file with the official one") from None
        if not isinstance(record, dict):
            raise UserError(f"{source}: line {lineno} is not a JSON object")
        records.append(_normalize(record, name, f"{source}: line {lineno}", f"{name}-{lineno:05d}"))
        sid = str(records[-1]["_id"])
        if sid in first_line:  # results are keyed by (task, id): two records would collide on resume
            raise UserError(f"{source}: line {lineno} repeats the _id {sid!r} of line {first_line[sid]}; "
                            "every record needs its own _id (replace the file with the official one)")
        first_line[sid] = lineno
    return records


def _normalize(record: dict, name: str, where: str, fallback_id: str) -> dict:
    """Check every field a task reads (names and types) and fill the optional ones the official files
    always have, so a bad record fails when the data is loaded, before any model work."""
    missing = [field for field in REQUIRED_FIELDS if field not in record]
    if missing:
        raise UserError(f"{where}: record has no {', '.join(repr(m) for m in missing)}; "
                        "LongBench records need 'input', 'context' and 'answers'")
    for field in ("input", "context"):
        if not isinstance(record[field], str):
            raise UserError(f"{where}: {field!r} must be a string, got {_type(record[field])}; "
                            "replace the file with the official one")
    answers = record["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise UserError(f"{where}: 'answers' must be a non-empty list of strings, got {_type(answers)}")
    classes = record.get("all_classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise UserError(f"{where}: 'all_classes' must be a list of strings or null, got {_type(classes)}")
    if not classes and name.removesuffix("_e") in CLASSIFIED:  # its metric reads the class names: refused at load
        raise UserError(f"{where}: {name} is scored by classification, which needs 'all_classes' (the list of "
                        f"class names), got {_type(classes)}; replace the file with the official one")
    length = record.get("length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))):
        raise UserError(f"{where}: 'length' must be a number, got {_type(length)}")
    if record.get("_id") is not None and (isinstance(record["_id"], bool) or not isinstance(record["_id"], (str, int))):
        raise UserError(f"{where}: '_id' must be a string, got {_type(record['_id'])}")
    out = dict(record)
    out["answers"] = answers
    if length is None:
        out["length"] = len(record["context"].split())
    out.setdefault("dataset", name)
    out.setdefault("language", "zh" if name.endswith("_zh") or name in ("dureader", "vcsum", "lsht") else "en")
    out["all_classes"] = classes
    if out.get("_id") is None:
        out["_id"] = fallback_id
    return out


def _type(value) -> str:
    """`null`, `a number`, ... as a user would read a JSON value's type."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list" + (" holding " + _type(next(v for v in value if not isinstance(v, str)))
                           if any(not isinstance(v, str) for v in value) else "")
    return {bool: "true/false", int: "a number", float: "a number", str: "a string", dict: "an object"}.get(
        type(value), type(value).__name__)


@contextmanager
def _reading(where: str):
    """A file that is not UTF-8 text, or cannot be read, becomes one line naming it."""
    try:
        yield
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text; replace it with the official LongBench jsonl file") from None
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise UserError(f"{where} cannot be read ({getattr(err, 'strerror', None) or err}); "
                        "replace it with the official LongBench file") from None


def _read_local(found: tuple[str, Path, str], name: str) -> list[dict]:
    kind, path, member = found
    if kind == "jsonl":
        with _reading(str(path)), open(path, encoding="utf-8-sig") as handle:
            return _parse_jsonl(handle, str(path), name)
    with _reading(f"{path}:{member}"), zipfile.ZipFile(path) as archive, archive.open(member) as raw:
        return _parse_jsonl(io.TextIOWrapper(raw, encoding="utf-8-sig"), f"{path}:{member}", name)


def _hub_worth_trying() -> bool:
    """False when the hub surely can't answer (not offline, and no connection to it): without this,
    `datasets` spends ~25 s retrying a host it cannot resolve. In offline mode (HF_HUB_OFFLINE=1)
    `datasets` answers from its cache at once, so let it try."""
    from ripplekv.engine.models import hub_offline, hub_reachable

    return hub_offline() or hub_reachable()


def _read_hub(name: str) -> list[dict]:
    """The Parquet copy on the hub (or in the local hub cache); any failure -> None."""
    if not _hub_worth_trying():
        return None
    try:
        import datasets

        data = datasets.load_dataset(HUB_ID, name, split="test")
        return [_normalize(dict(row), name, f"{HUB_ID}/{name} row {i}", f"{name}-{i:05d}")
                for i, row in enumerate(data, start=1)]
    except UserError:
        raise
    except Exception:  # offline, not cached, hub down, format changed: all mean "put the files here"
        return None


def read_records(name: str, data_dir: str | None = None) -> list[dict]:
    """All test records of dataset `name` (e.g. `hotpotqa`, `hotpotqa_e`) in file order."""
    where, explicit = _configured_dir(data_dir)
    found = _find_local(name, where)
    if found is not None:
        return _read_local(found, name)
    if explicit:
        raise UserError(f"LongBench file {name}.jsonl not found in {where}: put the official jsonl files "
                        "(or data.zip) there, or pass another --data-dir")
    records = _read_hub(name)
    if records is None:
        raise UserError(f"LongBench data not found: put the official jsonl files (or data.zip) in {where} "
                        f"or pass --data-dir (the hub copy {HUB_ID} could not be loaded; one already in "
                        "the HF cache loads with HF_HUB_OFFLINE=1)")
    return records


def where_data_is(data_dir: str | None = None) -> str:
    """One line for `ripplekv tasks`: whether LongBench files were found, and where ripplekv looked."""
    where, _ = _configured_dir(data_dir)
    found = [name for name in OFFICIAL_SIZES if _find_local(name, where)]
    if found:
        return f"LongBench data: {len(found)} of {len(OFFICIAL_SIZES)} datasets found in {where}"
    return (f"LongBench data: not found in {where} (put the official jsonl files or data.zip there, or use "
            f"--data-dir or ${ENV_DIR}; the offline suite needs no download)")


def has_local_data(data_dir: str | None = None) -> bool:
    """Whether any LongBench dataset is on disk where ripplekv looks (no network)."""
    where, _ = _configured_dir(data_dir)
    return any(_find_local(name, where) for name in OFFICIAL_SIZES)


def local_record_count(name: str, data_dir: str | None = None) -> int | None:
    """Number of records in the local copy of `name`, None when there is none (no network)."""
    found = _find_local(name, _configured_dir(data_dir)[0])
    if found is None:
        return None
    kind, path, member = found
    if kind == "jsonl":
        with _reading(str(path)), open(path, encoding="utf-8-sig") as handle:
            return sum(1 for line in handle if line.strip())
    with _reading(f"{path}:{member}"), zipfile.ZipFile(path) as archive, archive.open(member) as raw:
        return sum(1 for line in io.TextIOWrapper(raw, encoding="utf-8-sig") if line.strip())
