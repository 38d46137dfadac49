"""Issue 23's guards where the case is legitimate (correct numbers, not an error), and the shared
pieces they stand on: the run-file lists, the JSON-lines reader, the layer-table reader, canonical
spec labels and the cross-process GGUF cache lock."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ripplekv.errors import UserError
from tests.test_report import PLAN, TASKS, predictions, write


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- report on a torn run


def test_report_on_a_torn_run_names_the_sample_leaves_it_out_and_touches_only_its_own_files(tmp_path, run_cli):
    rows = predictions()
    torn_sample = [r for r in rows if r["id"] == "squad-1"]
    whole = [r for r in rows if r["id"] != "squad-1"] + torn_sample[:3]  # a kill after 3 of its variants
    cut = json.dumps(torn_sample[3])[:120]  # ... and mid-way through the 4th
    run = write(tmp_path / "run", whole, tail=cut)
    (run / "config.json").write_text(json.dumps({"command": "eval"}))
    inputs = {name: sha(run / name) for name in ("predictions.jsonl", "config.json")}
    code, _, err = run_cli("report", str(run))
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "torn line" in notes[0], err
    assert "sample squad/squad-1" in notes[0] and "3 lines of that sample are left out" in notes[0]
    assert f"variant {torn_sample[3]['method']}@{torn_sample[3]['budget']}" in notes[0]
    assert {name: sha(run / name) for name in inputs} == inputs  # never cut or rewritten by report
    scores = pd.read_csv(run / "scores.csv")
    squad = scores[scores.task == "squad"]
    assert (squad["n"] == 1).all() and (scores[scores.task != "squad"]["n"] == 2).all()  # every variant alike
    assert len(scores) == len(TASKS) * len(PLAN)
    from ripplekv.runs.files import OPTIONAL_REPORT_FILES, REPORT_FILES

    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == sorted(
        {"predictions.jsonl", "config.json", "lengths.csv",  # its lines carry prompt_tokens: buckets by length
         *(n for n in REPORT_FILES if n not in OPTIONAL_REPORT_FILES)})


# --------------------------------------------------------------------------- shared libraries


def test_one_list_of_run_files_covers_what_report_writes(tmp_path):
    from ripplekv.pipeline.run_config import RUN_FILES
    from ripplekv.runs.files import REPORT_FILES, run_kind

    assert {"ranks.csv", "lengths.csv", "report.json"} <= set(RUN_FILES) and set(REPORT_FILES) <= set(RUN_FILES)
    for kind, marker in (("eval", "predictions.jsonl"), ("profile", "samples.jsonl"), ("route", "route.json")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / marker).write_text("")
        assert run_kind(tmp_path / kind) == kind
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # a model folder is no run
    assert run_kind(tmp_path / "model") is None and run_kind(tmp_path / "absent") is None


def test_jsonl_reader_keeps_whole_lines_and_returns_the_torn_tail(tmp_path):
    from ripplekv.runs.jsonl import read_jsonl, torn_fields

    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"id": "s-1", "task": "niah", "method": "snap')
    lines = read_jsonl(path)
    assert lines.rows == [(1, {"a": 1}), (3, {"a": 2})] and lines.whole_size == len(b'{"a": 1}\n\n{"a": 2}\n')
    assert torn_fields(lines.torn) == {"id": "s-1", "task": "niah"}
    path.write_bytes(b'{"a": 1}\n[1]\n')
    with pytest.raises(UserError, match="line 2 is not a JSON object"):
        read_jsonl(path)


def test_layer_tables_are_read_exactly(tmp_path):
    from ripplekv.methods.allocators import read_allocation
    from ripplekv.methods.router import read_route

    alloc = tmp_path / "a.csv"
    alloc.write_bytes("\ufefflayer,sensitivity,multiplier\r\n2, 0.1,0.5\r\n0,0.3,2\r\n1,0.2,0\r\n".encode())
    assert read_allocation(alloc) == (2.0, 0.0, 0.5)  # BOM, CRLF, any row order; a 0 is DepthKV's floor
    route = tmp_path / "r.csv"
    route.write_text("method,layer\nh2o, 1\nsnapkv:window=16 ,0\n")
    assert read_route(route) == [(3, "snapkv:window=16"), (2, "h2o")]


def test_shipped_allocation_reads_as_pandas_read_it():
    """The strict reader must not move a multiplier by one ulp: budgets stay byte-identical."""
    from ripplekv.engine.models import DEFAULT_MODEL
    from ripplekv.methods.allocators import read_allocation

    shipped = Path(__file__).parent.parent / "src" / "ripplekv" / "data" / "allocations" / f"{DEFAULT_MODEL}.csv"
    table = pd.read_csv(shipped).sort_values("layer")
    assert read_allocation(shipped) == tuple(float(v) for v in table["multiplier"])


def test_spec_labels_are_canonical_and_usual_spellings_unchanged():
    from ripplekv.methods import make_method

    assert make_method("snapkv:window=016").label == make_method("snapkv:window=16").label == "snapkv:window=16"
    assert make_method("pyramidkv:beta=1e1").label == "pyramidkv:beta=10"
    assert make_method("pyramidkv:beta=10.50").label == "pyramidkv:beta=10.5"
    for spec in ("snapkv", "snapkv:kernel=5:window=8", "streamingllm:sinks=4", "snapkv:pooling=avg"):
        assert make_method(spec).label == spec


# --------------------------------------------------------------------------- GGUF cache across processes


# Each process reads the bundled GGUF's tokenizer for real, but its weights as a tiny random Llama that takes
# a few seconds to "dequantize": what is under test is the cache and its lock, not the dequantizer (the
# real-model tests go through it), and the 135M weights cost most of this test's time.
TINY_DEQUANTIZE = """
import time
import transformers

def tiny(*args, **kwargs):
    time.sleep(3)  # hold the lock long enough for the other process to wait on it
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config)

transformers.AutoModelForCausalLM.from_pretrained = tiny
from ripplekv.engine.models import load_config
print(load_config(None).num_hidden_layers)
"""


@pytest.mark.slow
def test_two_processes_loading_one_gguf_dequantize_it_once(tmp_path):
    """Both processes start on an empty cache; the file lock lets one write it and the other read it."""
    env = {**os.environ, "RIPPLEKV_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", TINY_DEQUANTIZE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out.strip() for out, _ in results] == ["2", "2"]
    assert sum(err.count("dequantizing") for _, err in results) == 1, results
    folders = [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / ".complete").is_file()


def test_the_gguf_cache_is_keyed_on_the_files_bytes_not_its_path_or_time(tmp_path, monkeypatch):
    """A fresh clone installs the bundled GGUF at a new path with a new mtime: it reuses the weights dequantized
    before; other bytes of the same size get their own folder."""
    from ripplekv.engine import models

    monkeypatch.setenv("RIPPLEKV_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    second.write_bytes(first.read_bytes())
    os.utime(second, ns=(10**18, 10**18))
    assert models._gguf_cache_dir(str(first)) == models._gguf_cache_dir(str(second))
    assert models._gguf_cache_dir(str(first)).parent == tmp_path / "cache" / "models"
    second.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)
    assert models._gguf_cache_dir(str(first)) != models._gguf_cache_dir(str(second))
    assert models.file_sha256(second) == hashlib.sha256(second.read_bytes()).hexdigest()
