"""Deliberate user mistakes across every command: each ends with exit code 2, exactly one `error:` line on
stderr, no traceback, and every input file left byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

PRED = {"dataset": "narrativeqa", "pred": "Max", "answers": ["Max Carl"], "all_classes": None}
ROUTE = "layer,method\n0,snapkv\n1,snapkv\n2,h2o\n3,snapkv\n"
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
        "folder.gguf/notes.txt": "a folder named as a GGUF file\n",
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
        # runs of other commands, which no command may write into
        "profile/per_sample.csv": "sample_id,layer,kl\n",
        "routerun/route.json": "{}\n",
        "routerun/ROUTE.csv": ROUTE,
        "allocdir/config.json": "layer,multiplier\n0,1\n1,1\n2,1\n3,1\n",
        "promptdir/kept.png": "a prompt, named as inspect names its plot\n",
        # layer tables (the tiny model has 4 layers)
        "r_inf.csv": "layer,method\ninf,snapkv\n1,snapkv\n2,snapkv\n3,snapkv\n",
        "r_empty.csv": "layer,method\n",
        "r_frac.csv": "layer,method\n0,snapkv\n1.5,snapkv\n2,snapkv\n3,snapkv\n",
        "r_short.csv": "layer,method\n0,snapkv\n1,snapkv\n2,snapkv\n",
        "r_dup.csv": "layer,method\n0,snapkv\n1,snapkv\n1,h2o\n2,snapkv\n",
        "r_unknown.csv": "layer,method\n0,snapkv\n1,nosuch\n2,snapkv\n3,snapkv\n",
        "r_full.csv": "layer,method\n0,snapkv\n1,full\n2,snapkv\n3,snapkv\n",
        "a_inf.csv": "layer,multiplier\n0,1\ninf,1\n2,1\n3,1\n",
        "a_frac.csv": "layer,multiplier\n0,1\n1,1\n1.5,1\n3,1\n",
        "a_infmult.csv": "layer,multiplier\n0,1\n1,inf\n2,1\n3,1\n",
        "a_dup.csv": "layer,multiplier\n0,1\n1,1\n1,1\n2,1\n3,1\n",
        "a_empty.csv": "layer,multiplier\n",
        "a_zero.csv": "layer,multiplier\n0,0\n1,0\n2,0\n3,0\n",
        # data records
        "lb_dup/hotpotqa.jsonl": _jsonl({"input": "q", "context": "c", "answers": ["a"], "_id": "x1"},
                                        {"input": "q2", "context": "c", "answers": ["b"], "_id": "x2"},
                                        {"input": "q3", "context": "c", "answers": ["c"], "_id": "x1"}),
        "lb_noans/hotpotqa.jsonl": _jsonl({"input": "q", "context": "c", "answers": []}),
        "empty_answers.jsonl": _jsonl(PRED, {**PRED, "answers": []}),
        "evalstyle_noans.jsonl": _jsonl({"task": "narrativeqa", "prediction": "Max", "answers": [], "method": "snapkv",
                                         "budget": 64}),
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
BUDGETS = ["budgets", "--model", "{model}", "--methods"]
INSPECT = ["inspect", "--model", "{model}", "--method", "snapkv", "--budget", "64", "--task", "niah", "--target-tokens", "300"]

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
    (["budgets", "--format", "xml"], "Invalid value for '--format': 'xml' is not one of 'table', 'csv'."),
    (["budgets", "--methods", "nosuch"], "nosuch"),
    (["budgets", "--model", "{d}/bad.gguf"], "is not a GGUF file"),
    (["budgets", "--model", "{d}/absent.gguf"], "does not exist"),
    (["budgets", "--model", "{d}/badcfg"], "config.json is not a readable JSON file"),
    (["budgets", "--model", "{d}/regular"], "is a file, not a model directory"),
    (["budgets", "--model", "{d}/folder.gguf"], "folder.gguf has no config.json"),  # a folder, whatever its name
    # eval
    ([*EVAL, "--out", "{d}/o", "--methods", ""], "--methods is empty"),
    ([*EVAL, "--out", "{d}/o", "--tasks", ""], "--tasks is empty"),
    ([*EVAL, "--out", "{d}/o", "--budget", "abc"], "budget must be a positive integer"),
    ([*EVAL, "--out", "{d}/o", "--limit", "0"], "--limit must be at least 1"),
    ([*EVAL, "--out", "{d}/o", "--limit", "1000000000000"], "at most 1000 samples per task"),
    ([*EVAL, "--out", "{d}/o", "--suite", "nope"], "Invalid value for '--suite': 'nope' is not one of"),
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
    ([*PROFILE, "--out", "{d}/p", "--signal", "prune"], "Invalid value for '--signal': 'prune' is not one of 'noise', 'evict', 'infonce'."),
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
    # calibration options beside one ratio (or none) choose nothing: refused, not silently ignored
    ([*ALLOCATE, "--out", "{d}/a.csv", "--budget", "64"], "--budget steer the calibration that chooses among several"),
    ([*ALLOCATE, "--out", "{d}/a.csv", "--ratio", "4", "--ratio", "4", "--calib-samples", "3", "--max-extensions", "1"],
     "--calib-samples, --max-extensions steer the calibration"),
    ([*ALLOCATE, "--out", "{d}/a.csv", "--map", "proportional", "--calib-samples", "3"], "--map proportional takes no ratio"),
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
    (["tasks", "--suite", "nope"], "Invalid value for '--suite': 'nope' is not one of"),
    # issue 23, class 1: an output that is an input, or a file of another command's run folder
    ([*ALLOCATE, "--out", "{d}/profile/per_sample.csv"], "holds a ripplekv profile"),
    (["allocate", "{d}/profile/sensitivity.csv", "--model", "{model}", "--out", "{d}/profile/sensitivity.png"],
     "holds a ripplekv profile"),
    (["allocate", "{d}/profile/sensitivity.csv", "--model", "{model}", "--out", "{d}/profile/sensitivity.csv"],
     "would overwrite the input"),
    ([*ALLOCATE, "--out", "{d}/routerun/ROUTE.csv"], "holds a ripplekv route"),
    ([*ALLOCATE, "--out", "{d}/evalrun/alloc.csv"], "holds an eval run"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/evalrun/scores.csv"], "holds an eval run"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/o.csv", "--samples", "{d}/profile/samples.csv"], "holds a ripplekv profile"),
    (["score", "{d}/preds.jsonl", "--out", "{d}/routerun/scores.csv"], "holds a ripplekv route"),
    ([*EVAL, "--out", "{d}/routerun"], "holds a ripplekv route, not an eval run"),
    ([*EVAL, "--out", "{d}/allocdir", "--methods", "ripplekv", "--allocation", "{d}/allocdir/config.json"],
     "would overwrite the input"),
    ([*PROFILE, "--out", "{d}/routerun"], "holds a ripplekv route, not a ripplekv profile"),
    (["route", "--model", "{model}", "--methods", "snapkv,h2o", "--out", "{d}/profile"], "holds a ripplekv profile"),
    (["route", "--model", "{model}", "--methods", "snapkv,h2o", "--out", "{d}/evalrun"], "holds an eval run"),
    (["route", "--model", "{model}", "--methods", "snapkv,h2o", "--out", "{d}/README.md"], "is a file"),
    (["route", "--model", "{model}", "--methods", "snapkv,h2o", "--out", "{d}/mine"], "holds other files"),
    (["route", "--model", "{model}", "--methods", "snapkv,h2o", "--out", "/proc/ripplekv"], "cannot be written"),
    ([*INSPECT, "--out", "{d}/profile"], "holds a ripplekv profile"),
    ([*INSPECT, "--out", "{d}/routerun"], "holds a ripplekv route"),
    ([*INSPECT, "--out", "{d}/README.md"], "is a file"),
    ([*INSPECT, "--out", "/proc/ripplekv"], "cannot be written"),
    (["inspect", "--model", "{model}", "--method", "snapkv", "--budget", "64", "--prompt-file", "{d}/promptdir/kept.png",
      "--out", "{d}/promptdir"], "would overwrite the input"),
    # class 2: layer tables (allocation and route CSVs)
    ([*BUDGETS, "routed", "--route", "{d}/r_inf.csv"], "line 2: layer 'inf' is not a layer id"),
    ([*BUDGETS, "routed", "--route", "{d}/r_empty.csv"], "has a header but no rows"),
    ([*BUDGETS, "routed", "--route", "{d}/r_frac.csv"], "line 3: layer '1.5' is not a layer id"),
    ([*BUDGETS, "routed", "--route", "{d}/r_short.csv"], "has 3 layers but the model has 4"),
    ([*BUDGETS, "routed", "--route", "{d}/r_dup.csv"], "line 4: layer 1 is listed twice (also line 3)"),
    ([*BUDGETS, "routed", "--route", "{d}/r_unknown.csv"], "line 3: unknown method 'nosuch'"),
    ([*BUDGETS, "routed", "--route", "{d}/r_full.csv"], "line 3: 'full' cannot be routed to"),
    ([*BUDGETS, "routed", "--route", "{d}/bin.csv"], "not UTF-8 text"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/a_inf.csv"], "line 3: layer 'inf' is not a layer id"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/a_frac.csv"], "line 4: layer '1.5' is not a layer id"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/a_infmult.csv"], "line 3: multiplier 'inf' is not a finite number"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/a_dup.csv"], "layer 1 is listed twice"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/a_empty.csv"], "has a header but no rows"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/a_zero.csv"], "has no positive multiplier"),
    ([*BUDGETS, "ripplekv", "--allocation", "{d}/two_layers.csv"], "lacks column(s) multiplier"),
    ([*EVAL, "--out", "{d}/o", "--methods", "routed", "--route", "{d}/r_short.csv"], "has 3 layers but the model has 4"),
    # class 3: specs are canonical (two spellings of one method are one method)
    ([*BUDGETS, "snapkv:window=16,snapkv:window=016"], "names one method twice"),
    ([*BUDGETS, "pyramidkv:beta=10,pyramidkv:beta=1e1"], "names one method twice"),
    ([*BUDGETS, "snapkv,snapkv:window=32"], "names one method twice (snapkv and snapkv:window=32)"),
    ([*EVAL, "--out", "{d}/o", "--methods", "snapkv:window=16,snapkv:window=016"], "share the label snapkv:window=16"),
    ([*EVAL, "--out", "{d}/o", "--methods", "h2o,h2o:recent=0.50"], "names one method twice"),
    # class 4: data records
    ([*LB, "--data-dir", "{d}/lb_dup"], "line 3 repeats the _id 'x1' of line 1"),
    (["score", "{d}/evalstyle_noans.jsonl", "--out", "{d}/o.csv"], "line 1: 'answers' is an empty list"),
    ([*LB, "--data-dir", "{d}/lb_noans"], "'answers' must be a non-empty list of strings"),
    (["score", "{d}/empty_answers.jsonl", "--out", "{d}/o.csv"], "line 2: 'answers' is an empty list"),
    # class 5: fail before work (Ray addresses, route candidates)
    ([*EVAL, "--out", "{d}/o", "--ray-address", "garbage"], "is not a cluster address"),
    ([*EVAL, "--out", "{d}/o", "--ray-address", "ray://"], "is not a cluster address"),
    ([*EVAL, "--out", "{d}/o", "--ray-address", "nosuchhost.invalid:6379"], "no Ray cluster answers"),
    ([*PROFILE, "--out", "{d}/p", "--ray-address", "host:notaport"], "is not a cluster address"),
    (["route", "--model", "{model}", "--methods", "snapkv,snapkv", "--out", "{d}/r"], "lists a candidate twice"),
    (["route", "--model", "{model}", "--methods", "snapkv,h2o,snapkv:window=32", "--out", "{d}/r"], "names one method twice"),
    (["route", "--model", "{model}", "--methods", "tova,tova:window=01", "--out", "{d}/r"], "names one method twice"),
    # one form per option: --budget is checked alike everywhere, choices are checked while parsing
    ([*INSPECT, "--out", "{d}/i", "--budget", "64,128"], "--budget takes one budget here, got '64,128'; only eval"),
    (["route", "--model", "{model}", "--budget", "abc", "--out", "{d}/r"], "budget must be a positive integer, got 'abc'"),
    ([*ALLOCATE, "--out", "{d}/a.csv", "--budget", "-1"], "budget must be a positive integer"),
    ([*EVAL, "--out", "{d}/o", "--dtype", "fp8"], "Invalid value for '--dtype': 'fp8' is not one of 'auto', 'float32'"),
    ([*INSPECT, "--out", "{d}/i", "--suite", "nope"], "Invalid value for '--suite': 'nope' is not one of"),
    ([*EVAL, "--out", "{d}/o", "--seed", "x"], "Invalid value for '--seed'"),
]


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


def test_budgets_resolves_the_allocation_as_eval_does(run_cli, tmp_path, monkeypatch):
    """`budgets --methods ripplekv` on the bundled model uses the allocation shipped for it, as `eval` does."""
    from ripplekv.methods import make_method
    from ripplekv.pipeline.eval_plan import default_allocation

    monkeypatch.chdir(tmp_path)  # no runs/allocate/allocation.csv here: the shipped one applies
    code, out, err = run_cli("budgets", "--methods", "ripplekv", "--budget", "64", "--format", "csv")
    assert code == 0, err
    assert "using the allocation shipped for" in err
    shipped, _ = default_allocation(["ripplekv"], bundled=True)
    expected = make_method("ripplekv", allocation=shipped).layer_budgets(30, 64, 3500)
    assert [int(line.split(",")[2]) for line in out.strip().splitlines()[1:]] == expected
    assert len(set(expected)) > 1  # a real allocation, not uniform
