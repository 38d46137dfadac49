"""Real LongBench loading: jsonl folder, official data.zip, clear errors, no hub call when offline."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ripplekv.errors import UserError
from ripplekv.tasks import default_suite, get_tasks, load_samples, longbench
from ripplekv.tasks.registry import task_rows

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
FIELDS = {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}


@pytest.fixture(autouse=True)
def _no_env_dir(monkeypatch, tmp_path):
    """Tests never see the developer's own LongBench folder or cache."""
    monkeypatch.delenv("RIPPLEKV_LONGBENCH_DIR", raising=False)
    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path / "cache"))


def _task(name: str, suite: str = "longbench"):
    return get_tasks(suite, [name])[0]


def _zip_of_fixtures(path: Path, prefix: str = "data/") -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for file in sorted(FIXTURES.glob("*.jsonl")):
            archive.write(file, prefix + file.name)
    return path


def test_load_from_jsonl_folder(tokenizer):
    records = load_samples(_task("hotpotqa"), tokenizer, data_dir=str(FIXTURES))
    assert len(records) == 3
    assert all(FIELDS <= set(r) for r in records)
    assert records[0]["answers"] == ["London"] and records[0]["_id"] == "fixture-hotpotqa-001"
    assert load_samples(_task("hotpotqa"), tokenizer, data_dir=str(FIXTURES), limit=2) == records[:2]


def test_load_from_official_zip(tokenizer, tmp_path):
    folder_records = load_samples(_task("samsum"), tokenizer, data_dir=str(FIXTURES))
    archive = _zip_of_fixtures(tmp_path / "data.zip")
    assert load_samples(_task("samsum"), tokenizer, data_dir=str(tmp_path)) == folder_records  # zip in folder
    assert load_samples(_task("samsum"), tokenizer, data_dir=str(archive)) == folder_records  # zip as the path
    assert longbench.local_record_count("hotpotqa", str(archive)) == 3


def test_env_var_and_unpacked_zip_layout(tokenizer, tmp_path, monkeypatch):
    shutil.copytree(FIXTURES, tmp_path / "data")  # data.zip unpacks into data/<name>.jsonl
    monkeypatch.setenv("RIPPLEKV_LONGBENCH_DIR", str(tmp_path))
    records = load_samples(_task("lcc"), tokenizer)
    assert records[0]["answers"][0].startswith("        return dict(")


def test_longbench_e_reads_the_e_files(tokenizer, tmp_path):
    shutil.copy(FIXTURES / "hotpotqa.jsonl", tmp_path / "hotpotqa_e.jsonl")
    records = load_samples(_task("hotpotqa_e", "longbench-e"), tokenizer, data_dir=str(tmp_path))
    assert len(records) == 3
    with pytest.raises(UserError, match="hotpotqa.jsonl not found"):
        load_samples(_task("hotpotqa"), tokenizer, data_dir=str(tmp_path))


def test_missing_fields_get_official_defaults(tokenizer, tmp_path):
    (tmp_path / "triviaqa.jsonl").write_text(json.dumps({"input": "q", "context": "a b c", "answers": ["LOC"]}) + "\n")
    (record,) = load_samples(_task("triviaqa"), tokenizer, data_dir=str(tmp_path))
    assert record["length"] == 3 and record["dataset"] == "triviaqa" and record["_id"] == "triviaqa-00001"
    assert record["all_classes"] is None


@pytest.mark.parametrize("suite, name", [("longbench", "trec"), ("longbench-e", "trec_e"), ("longbench", "lsht")])
def test_a_record_without_what_its_metric_reads_is_refused_at_load(tokenizer, tmp_path, suite, name):
    """Classification scores against the class names: a record without them is refused when the data loads,
    not after every variant has decoded."""
    record = {"input": "q", "context": "a b c", "answers": ["LOC"]}
    for classes in (None, []):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({**record, "all_classes": classes}) + "\n")
        with pytest.raises(UserError, match=rf"{name}\.jsonl: line 1: .* needs 'all_classes'"):
            load_samples(_task(name, suite), tokenizer, data_dir=str(tmp_path))


def test_a_file_that_starts_with_a_utf8_bom_reads_as_the_csv_readers_do(tokenizer, tmp_path):
    text = (FIXTURES / "hotpotqa.jsonl").read_text(encoding="utf-8")
    (tmp_path / "hotpotqa.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert load_samples(_task("hotpotqa"), tokenizer, data_dir=str(tmp_path)) == \
        load_samples(_task("hotpotqa"), tokenizer, data_dir=str(FIXTURES))


def test_malformed_line_names_file_and_line(tokenizer, tmp_path):
    lines = (FIXTURES / "hotpotqa.jsonl").read_text().splitlines()
    lines[1] = lines[1][:40]
    (tmp_path / "hotpotqa.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"hotpotqa\.jsonl: line 2 is not valid JSON"):
        load_samples(_task("hotpotqa"), tokenizer, data_dir=str(tmp_path))


def test_malformed_line_inside_zip(tokenizer, tmp_path):
    with zipfile.ZipFile(tmp_path / "data.zip", "w") as archive:
        archive.writestr("data/samsum.jsonl", (FIXTURES / "samsum.jsonl").read_text() + "{oops\n")
    with pytest.raises(UserError, match=r"data\.zip:data/samsum\.jsonl: line 2"):
        load_samples(_task("samsum"), tokenizer, data_dir=str(tmp_path))


def test_record_without_answers(tokenizer, tmp_path):
    (tmp_path / "lcc.jsonl").write_text(json.dumps({"input": "", "context": "x = 1\n"}) + "\n")
    with pytest.raises(UserError, match=r"lcc\.jsonl: line 1: record has no 'answers'"):
        load_samples(_task("lcc"), tokenizer, data_dir=str(tmp_path))


def test_longbench_has_no_calibration_split(tokenizer):
    with pytest.raises(UserError, match="offline"):
        load_samples(_task("hotpotqa"), tokenizer, split="calibration", data_dir=str(FIXTURES))
    with pytest.raises(UserError, match="unknown split"):
        load_samples(_task("hotpotqa"), tokenizer, split="test", data_dir=str(FIXTURES))


def test_default_suite_and_task_sizes(tmp_path):
    assert default_suite(str(FIXTURES)) == "longbench"
    assert default_suite(str(tmp_path)) == "offline"
    rows = {row["task"]: row for row in task_rows("longbench", str(FIXTURES))}
    assert rows["hotpotqa"]["size"] == "3 local" and rows["narrativeqa"]["size"] == "200 official"
    assert rows["lcc"]["size"] == "1 local"
    e_rows = {row["task"]: row["size"] for row in task_rows("longbench-e", str(tmp_path))}
    assert e_rows["qasper_e"] == "224 official" and e_rows["multi_news_e"] == "294 official"


def test_no_data_and_hub_offline_gives_one_clear_error(tmp_path):
    """Nothing on disk, HF offline: one UserError line, quickly (run apart so HF reads the env fresh)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "RIPPLEKV_CACHE": str(tmp_path / "cache")}
    env.pop("RIPPLEKV_LONGBENCH_DIR", None)
    code = (
        "from ripplekv.tasks import get_tasks, load_samples\n"
        "from ripplekv.errors import UserError\n"
        "try:\n"
        "    load_samples(get_tasks('longbench', ['qasper'])[0], None)\n"
        "except UserError as err:\n"
        "    print('USERERROR', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out.startswith("USERERROR LongBench data not found: put the official jsonl files (or data.zip) in ")
    assert str(tmp_path / "cache" / "longbench") in out and "--data-dir" in out
    assert "\n" not in out


def test_unreachable_hub_fails_fast_without_retries(tmp_path, monkeypatch):
    """No network and no offline flag: the hub is skipped after one failed connection."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)

    attempts = []

    def refuse(address, timeout=None, *args, **kwargs):
        attempts.append(timeout)
        raise OSError("no route to host")

    monkeypatch.setattr("socket.create_connection", refuse)
    with pytest.raises(UserError, match="LongBench data not found"):
        load_samples(_task("qasper"), None)
    # one short probe and no download retries (each would be another connection attempt)
    assert len(attempts) == 1 and attempts[0] is not None and attempts[0] <= 5


def test_tasks_command(tmp_path):
    exe = Path(sys.executable).parent / "ripplekv"
    env = {**os.environ, "RIPPLEKV_CACHE": str(tmp_path / "cache")}
    env.pop("RIPPLEKV_LONGBENCH_DIR", None)
    done = subprocess.run([str(exe), "tasks", "--data-dir", str(FIXTURES)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for text in ("niah_multikey", "passage_retrieval_en", "repobench-p_e", "3 local", "500 official", "string_match"):
        assert text in done.stdout
    assert f"datasets found in {FIXTURES}" in done.stdout
    missing = subprocess.run([str(exe), "tasks", "--data-dir", str(tmp_path / "none")], env=env,
                             capture_output=True, text=True, timeout=120)
    assert f"LongBench data: not found in {tmp_path / 'none'}" in missing.stdout
    bad = subprocess.run([str(exe), "tasks", "--suite", "nope"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: Invalid value for '--suite': 'nope' is not one of 'offline', 'ruler', 'longbench', 'longbench-e', 'longbench-v2', 'scbench'."


@pytest.mark.parametrize("offline", [True, False])
def test_a_mistyped_hub_model_fails_without_retries(offline, monkeypatch, run_cli):
    """Offline, or the hub unreachable: one line at once, no download retries."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    attempts = []

    def refuse(address, timeout=None, *args, **kwargs):
        attempts.append(timeout)
        raise OSError("unreachable")

    monkeypatch.setattr("socket.create_connection", refuse)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli("budgets", "--model", "no-such-org/no-such-model-xyz")
    # offline: no connection at all; unreachable: one short probe, no download retries
    assert attempts == [] if offline else (len(attempts) == 1 and attempts[0] <= 5)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not in the local hub cache" in err and ("switched off" if offline else "cannot be reached") in err


@pytest.mark.parametrize("field, value, message", [("_id", True, "'_id' must be a string, got true"),
                                                   ("_id", 1.5, "'_id' must be a string"),
                                                   ("length", "900", "'length' must be a number, got a string"),
                                                   ("context", ["a"], "'context' must be a string")])
def test_a_field_of_the_wrong_json_type_is_refused_at_load(tokenizer, tmp_path, field, value, message):
    record = {"input": "q", "context": "a b c", "answers": ["x"], field: value}
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=re.escape(message)):
        load_samples(_task("hotpotqa"), tokenizer, data_dir=str(tmp_path))


def test_the_records_checked_for_classes_are_the_classification_datasets():
    from ripplekv.tasks.registry import LONGBENCH_DATASETS

    assert set(longbench.CLASSIFIED) == {name for name, (_, metric) in LONGBENCH_DATASETS.items()
                                         if metric == "classification"}
