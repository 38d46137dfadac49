"""Deliberate user mistakes across every command: each ends with exit code 2, exactly one `error:` line on
stderr, no traceback, and every input file left byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

PRED = {"dataset": "narrativeqa", "pred": "Max", "answers": ["Max Carl"], "all_classes": None}
SENSITIVITY = "layer,kl_mean,kl_std,kl_median,n_samples\n0,0.1,0,0.1,2\n1,0.4,0,0.4,2\n2,0.2,0,0.2,2\n3,0.3,0,0.3,2\n"


def _jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir) -> Path:
    """A folder of user files, good and broken, shared by all cases (none may ever change)."""
    root = tmp_path_factory.mktemp("mistakes")
    files = {
        "preds.jsonl": _jsonl(PRED),
        "null_answer.jsonl": _jsonl({**PRED, "answers": [None]}),
        "empty.jsonl": "",
        "sens.csv": SENSITIVITY,
        "a.sweep.csv": SENSITIVITY,
        "two_layers.csv": "layer,kl_mean\n0,1\n1,2\n",
        "nan_sens.csv": "layer,kl_mean\n0,1\n1,nan\n2,1\n3,1\n",
        "README.md": "# my notes\n",
        "regular": "a file, not a folder\n",
        "alloc.csv": "layer,multiplier\n0,1\n1,1\n2,1\n3,1\n",
        "other/alloc.csv": "layer,multiplier\n0,2\n1,1\n2,0.5\n3,0.5\n",
        "badcfg/config.json": "{not json",
        "noweights/config.json": (tiny_model_dir / "config.json").read_text(),
        "notok/config.json": (tiny_model_dir / "config.json").read_text(),
        "lb_num/hotpotqa.jsonl": _jsonl({"input": "q", "context": "c", "answers": [5]}),
        "lb_null/hotpotqa.jsonl": _jsonl({"input": None, "context": "c", "answers": ["a"]}),
        "lb_nullans/hotpotqa.jsonl": _jsonl({"input": "q", "context": "c", "answers": [None]}),
        "lb_classes/trec.jsonl": _jsonl({"input": "q", "context": "c", "answers": ["a"], "all_classes": "a"}),
        "lb_json/hotpotqa.jsonl": "{broken\n",
        "profile/profile.json": "{}\n",
        "profile/sensitivity.csv": SENSITIVITY,
        "evalrun/config.json": json.dumps({"command": "eval"}),
        "evalrun/predictions.jsonl": "not json\n",
        "mine/notes.txt": "my own notes\n",
        "oddrun/config.json": json.dumps({"command": "eval"}),
        "oddrun/predictions.jsonl": "[1, 2]\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "notok" / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes()[:64])
    binary = bytes(range(128, 256)) * 20
    for name in ("bin.jsonl", "bad.gguf", "lb_bin/hotpotqa.jsonl", "bin.csv", "binrun/predictions.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(binary + b"\n")
    return root


def snapshot(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


EVAL = ["eval", "--model", "{model}", "--methods", "snapkv", "--tasks", "niah", "--limit", "1",
        "--target-tokens", "300", "--budget", "64"]
LB = ["eval", "--model", "{model}", "--methods", "snapkv", "--suite", "longbench", "--budget", "64", "--out", "{d}/o",
      "--tasks", "hotpotqa"]
PROFILE = ["profile", "--model", "{model}", "--calib-samples", "1", "--target-tokens", "300"]
ALLOCATE = ["allocate", "{d}/sens.csv", "--model", "{model}"]

# (args, a piece of the one error line)
CASES = [
    # score
    (["score", "{d}/preds.jsonl", "--out", "{d}/preds.jsonl"], "would overwrite the input"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/o.csv", "--samples", "{d}/preds.jsonl"], "would overwrite the input"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/o.csv", "--samples", "{d}/o.csv"], "would overwrite the input"),
    (["score", "{d}/bin.jsonl", "--out", "{d}/o.csv"], "is not UTF-8 text"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/regular/o.csv"], "is a file, not a directory"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/profile"], "is a directory"),
    (["score", "{d}/preds.jsonl", "--out", "/proc/ripplekv/o.csv"], "cannot be written"),
    (["score", "{d}/absent.jsonl", "--out", "{d}/o.csv"], "predictions file not found"),
    (["score", "{d}/null_answer.jsonl", "--out", "{d}/o.csv"], "'answers' must hold strings"),
    (["score", "{d}/empty.jsonl", "--out", "{d}/o.csv"], "no predictions"),
    # budgets and models
    (["budgets", "--methods", ""], "--methods is empty"),
    (["budgets", "--methods", " , "], "--methods is empty"),
    (["budgets", "--budget", "0"], "budget must be a positive integer"),
    (["budgets", "--prompt-len", "0"], "--prompt-len must be a positive"),
    (["budgets", "--format", "xml"], "--format must be table or csv"),
    (["budgets", "--methods", "nosuch"], "nosuch"),
    (["budgets", "--model", "{d}/bad.gguf"], "is not a GGUF file"),
    (["budgets", "--model", "{d}/absent.gguf"], "does not exist"),
    (["budgets", "--model", "{d}/badcfg"], "config.json is not a readable JSON file"),
    (["budgets", "--model", "{d}/regular"], "has no config.json"),
    # eval
    ([*EVAL, "--out", "{d}/o", "--methods", ""], "--methods is empty"),
    ([*EVAL, "--out", "{d}/o", "--tasks", ""], "--tasks is empty"),
    ([*EVAL, "--out", "{d}/o", "--budget", "abc"], "budget must be a positive integer"),
    ([*EVAL, "--out", "{d}/o", "--limit", "0"], "--limit must be at least 1"),
    ([*EVAL, "--out", "{d}/o", "--limit", "1000000000000"], "at most 1000 samples per task"),
    ([*EVAL, "--out", "{d}/o", "--suite", "nope"], "unknown suite"),
    ([*EVAL, "--out", "{d}/o", "--tasks", "nope"], "unknown task"),
    ([*EVAL, "--out", "{d}/o", "--target-tokens", "10"], "target length must be at least"),
    ([*EVAL, "--out", "{d}/o", "--target-tokens", "100000000000"], "at most"),
    ([*EVAL, "--out", "{d}/o", "--max-length", "1"], "--max-length must be at least 2"),
    ([*EVAL, "--out", "{d}/o", "--batch-size", "0"], "--batch-size must be at least 1"),
    ([*EVAL, "--out", "{d}/o", "--methods", "ripplekv"], "needs an allocation"),
    ([*EVAL, "--out", "{d}/o", "--methods", "ripplekv", "--allocation", "{d}/absent.csv"], "does not exist"),
    ([*EVAL, "--out", "{d}/o", "--methods", "depthkv:allocation={d}/alloc.csv,depthkv:allocation={d}/other/alloc.csv"],
     "share the label depthkv:allocation=alloc.csv"),
    ([*EVAL, "--out", "{d}/o", "--model", "{d}/noweights"], "has no tokenizer"),
    ([*EVAL, "--out", "{d}/o", "--model", "{d}/notok"], "has no tokenizer"),
    ([*EVAL, "--out", "{d}/regular/o"], "is a file, not a directory"),
    ([*EVAL, "--out", "{d}/README.md"], "is a file; pass a directory"),
    ([*EVAL, "--out", "/proc/ripplekv"], "cannot be written"),
    ([*EVAL, "--out", "{d}/profile"], "holds a ripplekv profile"),
    ([*EVAL, "--out", "{d}/mine"], "holds other files"),
    ([*LB, "--data-dir", "{d}/lb_bin"], "is not UTF-8 text"),
    ([*LB, "--data-dir", "{d}/lb_num"], "'answers' must be a non-empty list of strings, got a list holding a number"),
    ([*LB, "--data-dir", "{d}/lb_null"], "'input' must be a string, got null"),
    ([*LB, "--data-dir", "{d}/lb_nullans"], "got a list holding null"),
    ([*LB, "--data-dir", "{d}/lb_json"], "is not valid JSON"),
    ([*LB[:-1], "trec", "--data-dir", "{d}/lb_classes"], "'all_classes' must be a list of strings"),
    ([*LB, "--data-dir", "{d}/absent"], "not found"),
    # profile
    ([*PROFILE, "--out", "{d}/p", "--eta", "nan"], "--eta must be a number in (0, 100]"),
    ([*PROFILE, "--out", "{d}/p", "--eta", "0"], "--eta must be a number"),
    ([*PROFILE, "--out", "{d}/p", "--eta", "-1"], "--eta must be a number"),
    ([*PROFILE, "--out", "{d}/p", "--eta", "inf"], "--eta must be a number"),
    ([*PROFILE, "--out", "{d}/p", "--seeds", "0"], "must be positive integers"),
    ([*PROFILE, "--out", "{d}/p", "--seeds", "1000000000"], "--seeds must be at most"),
    ([*PROFILE, "--out", "{d}/p", "--signal", "prune"], "unknown signal"),
    ([*PROFILE, "--out", "{d}/p", "--calib-samples", "0"], "--calib-samples must be at least 1"),
    ([*PROFILE, "--out", "{d}/p", "--calib-samples", "100000"], "at most 1000 samples"),
    ([*PROFILE, "--out", "{d}/README.md"], "is a file; pass a directory"),
    ([*PROFILE, "--out", "{d}/regular/p"], "is a file, not a directory"),
    ([*PROFILE, "--out", "{d}/evalrun"], "holds an eval run"),
    ([*PROFILE, "--out", "{d}/mine"], "holds other files"),
    ([*PROFILE, "--out", "{d}/p", "--model", "{d}/bad.gguf"], "is not a GGUF file"),
    # allocate
    ([*ALLOCATE, "--out", "{d}/sens.csv"], "would overwrite the input"),
    (["allocate", "{d}/a.sweep.csv", "--model", "{model}", "--out", "{d}/a.csv"], "would overwrite the input"),
    ([*ALLOCATE, "--out", "{d}/regular/a.csv"], "is a file, not a directory"),
    ([*ALLOCATE, "--out", "{d}/profile"], "is a directory"),
    ([*ALLOCATE, "--out", "{d}/a.csv", "--ratio", "nan"], "--ratio must be a number >= 1"),
    ([*ALLOCATE, "--out", "{d}/a.csv", "--ratio", "0.5"], "--ratio must be a number >= 1"),
    ([*ALLOCATE, "--out", "{d}/a.csv", "--calib-samples", "0", "--ratio", "2", "--ratio", "4"], "at least 1"),
    (["allocate", "{d}/absent.csv", "--model", "{model}", "--out", "{d}/a.csv"], "does not exist"),
    (["allocate", "{d}/two_layers.csv", "--model", "{model}", "--out", "{d}/a.csv"], "has 2 layers but the model has 4"),
    (["allocate", "{d}/nan_sens.csv", "--model", "{model}", "--out", "{d}/a.csv"], "non-numeric"),
    (["allocate", "{d}/bin.csv", "--model", "{model}", "--out", "{d}/a.csv"], "not a readable CSV"),
    # report, tasks
    (["report", "{d}/profile"], "holds a ripplekv profile"),
    (["report", "{d}/regular"], "is a file"),
    (["report", "{d}/absent"], "does not exist"),
    (["report", "{d}/evalrun"], "is not valid JSON"),
    (["report", "{d}/oddrun"], "is not a JSON object"),
    (["report", "{d}/binrun"], "is not valid JSON"),
    (["tasks", "--suite", "longbench", "--data-dir", "{d}/lb_bin"], "is not UTF-8 text"),
    (["tasks", "--suite", "nope"], "unknown suite"),
]


def test_there_are_at_least_40_mistakes():
    assert len(CASES) >= 40


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_a_mistake_is_one_line_exit_2_and_touches_no_input(inputs, tiny_model_dir, run_cli, args, message):
    before = snapshot(inputs, tiny_model_dir)
    code, _, err = run_cli(*[a.format(d=inputs, model=tiny_model_dir) for a in args])
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert message in err, err
    after = snapshot(inputs, tiny_model_dir)
    assert {k: v for k, v in after.items() if k in before} == before
