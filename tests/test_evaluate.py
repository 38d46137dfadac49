"""`ripplekv eval` on a tiny random model: outputs, exact budgets, fidelity, resuming, config guard."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from ripplekv.analysis import report
from ripplekv.cli import app as cli
from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine.decode import stop_tokens
from ripplekv.errors import UserError
from ripplekv.pipeline import eval_plan, evaluate, progress, run_config
from ripplekv.runs import resume
from tests.conftest import check_fidelity, without_peak_memory

BUDGETS = (32, 64)
METHODS = ("full", "snapkv", "streamingllm", "pyramidkv", "ripplekv", "random")
TASKS = ("niah", "squad")
LAYERS, KV_HEADS = 4, 2
VARIANTS = 1 + (len(METHODS) - 1) * len(BUDGETS)
CSVS = ("scores.csv", "leaderboard.csv", "leaderboard_wide.csv")


@pytest.fixture(scope="module")
def allocation(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("alloc") / "alloc.csv"
    path.write_text("layer,multiplier\n0,1.5\n1,1.0\n2,0.75\n3,0.75\n")
    return path


@pytest.fixture(scope="module")
def eval_args(tiny_model_dir, allocation):
    def make(out, *extra: str) -> list[str]:
        args = ["eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", ",".join(TASKS),
                "--limit", "1", "--target-tokens", "300", "--methods", ",".join(METHODS),
                "--allocation", str(allocation), "--batch-size", "4", "--out", str(out)]
        for budget in BUDGETS:
            args += ["--budget", str(budget)]
        return args + list(extra)

    return make


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, eval_args) -> Path:
    """One uninterrupted run, shared by the tests below (they copy it before changing anything). It spells out
    the default `--decode-budget prompt`: the runs compared with it without the option show that the option
    changes nothing, byte for byte (test_a_killed_run_...), without a run of their own."""
    out = tmp_path_factory.mktemp("base") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIPPLEKV_PLOTS", "1")  # its figures are checked below
        mp.setattr(sys, "argv", ["ripplekv", *eval_args(out, "--decode-budget", "prompt")])
        with pytest.raises(SystemExit) as stop:
            cli.main()
    assert stop.value.code == 0
    return out


def lines(run: Path) -> list[str]:
    """The run's lines without their measured peak memory (the one field that differs between equal runs)."""
    return without_peak_memory((run / "predictions.jsonl").read_text(encoding="utf-8")).splitlines()


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in lines(run)]


def copy_run(base: Path, target: Path) -> Path:
    shutil.copytree(base, target)
    return target


@pytest.mark.slow
def test_eval_writes_every_output_with_its_columns(base_run):
    for name in ("predictions.jsonl", "config.json", "summary.md", *CSVS, *report.FIGURES):
        assert (base_run / name).is_file() and (base_run / name).stat().st_size > 0, name
    records = rows(base_run)
    assert len(records) == len(TASKS) * VARIANTS
    needed = {"id", "task", "category", "method", "budget", "prediction", "answers", "score", "kept_entries",
              "kl", "agreement", "prompt_tokens", "layer_budgets"}
    assert all(needed <= set(r) for r in records)
    assert {(r["method"], r["budget"]) for r in records} == resume.variant_keys(
        {"methods": list(METHODS), "budgets": list(BUDGETS)})
    assert list(pd.read_csv(base_run / "scores.csv").columns) == [
        "task", "category", "method", "budget", "n", "score", "kl", "agreement", "protocol", "informative"]
    board = pd.read_csv(base_run / "leaderboard.csv")
    assert {"method", "budget", "rank", "avg", "kl", "agreement", "Synthetic", "Single-Doc QA"} <= set(board.columns)
    assert len(board) == VARIANTS
    assert board.loc[board["method"] == "full", "rank"].isna().all()
    assert board.loc[board["method"] != "full", "rank"].between(1, len(METHODS) - 1).all()
    wide = pd.read_csv(base_run / "leaderboard_wide.csv")
    assert set(TASKS) <= set(wide.columns) and "avg" in wide.columns
    config = json.loads((base_run / "config.json").read_text())
    assert config["budgets"] == list(BUDGETS) and config["methods"] == list(METHODS)
    assert config["model_label"] and config["ripplekv_version"]
    assert len(config["allocation_sha256"]) == 64
    assert set(config["samples"]) == set(TASKS) and all(len(ids) == 1 for ids in config["samples"].values())
    assert "| method |" in (base_run / "summary.md").read_text()


def test_eval_writes_a_page_that_quotes_each_samples_question(base_run):
    from ripplekv.analysis.page_data import run_page_data

    full = [r for r in rows(base_run) if r["method"] == "full"]
    assert full and all(0 < len(r["question"]) <= 300 for r in full)
    assert all("question" not in r for r in rows(base_run) if r["method"] != "full")  # once per sample
    assert "<svg" not in (base_run / "index.html").read_text() and (base_run / "index.html").stat().st_size > 10_000
    worst = next(p["worst"] for m, p in run_page_data(base_run)["methods"].items() if m != "full")
    assert worst and all(s["excerpt"] in [r["question"] for r in full] for s in worst)
    # `report --site --questions` rebuilds them for runs that predate recording them: the same text
    from ripplekv.pipeline.pages import rebuilt_questions

    assert rebuilt_questions(base_run) == {r["id"]: r["question"] for r in full}


@pytest.mark.slow
def test_full_cache_is_the_models_own_greedy_answer(base_run, tiny_model_dir):
    """The reference row must be what the stock model generates on the same prompt (not just labelled so)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = {r["task"]: r for r in rows(base_run) if r["method"] == "full"}
    assert set(full) == set(TASKS) and all(r["budget"] is None for r in full.values())
    for task in get_tasks("offline", list(TASKS)):
        record = load_samples(task, tokenizer, limit=1, target_tokens=300)[0]
        ids = torch.tensor([build_prompt_ids(task, record, tokenizer, 7500)])
        out = model.generate(ids, max_new_tokens=task.max_new_tokens, do_sample=False,
                             eos_token_id=stop_tokens(model, tokenizer, task.stop_at_newline), pad_token_id=0)
        assert full[task.name]["prediction"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    check_fidelity(rows(base_run))
    assert any(r["agreement"] < 1.0 for r in rows(base_run))  # the checks above saw both of their cases
    assert all(0.0 <= r["score"] <= 1.0 for r in rows(base_run))


@pytest.mark.slow
def test_every_method_keeps_exactly_the_same_entries(base_run):
    for r in rows(base_run):
        n = r["prompt_tokens"]
        assert len(r["layer_budgets"]) == LAYERS
        if r["method"] == "full":
            assert r["kept_entries"] == LAYERS * KV_HEADS * n
        else:
            assert n > r["budget"]
            assert r["kept_entries"] == LAYERS * KV_HEADS * r["budget"]
            assert sum(r["layer_budgets"]) == LAYERS * r["budget"]


@pytest.mark.slow
def test_a_killed_run_resumes_to_exactly_the_uninterrupted_lines(base_run, eval_args, tmp_path, monkeypatch, run_cli):
    """Interrupted after its first sample, then killed mid-write of the second (3 of its lines and half of the
    4th on disk): the rerun drops only the sample in flight and ends with the uninterrupted run's lines. Run
    without `--decode-budget`, it also shows base_run's explicit `--decode-budget prompt` is the default:
    the same predictions, config.json and tables, byte for byte."""
    out = tmp_path / "run"
    real_append = evaluate.append_rows

    def append_then_die(fh, sample_rows):
        real_append(fh, sample_rows)
        raise KeyboardInterrupt  # killed right after the first sample was written

    monkeypatch.setattr(evaluate, "append_rows", append_then_die)
    code, _, err = run_cli(*eval_args(out))
    assert code == 130 and "interrupted" in err
    assert lines(out) == lines(base_run)[:VARIANTS]
    monkeypatch.setattr(evaluate, "append_rows", real_append)
    text = (base_run / "predictions.jsonl").read_text(encoding="utf-8")
    partial_next = "".join(line + "\n" for line in lines(base_run)[VARIANTS : VARIANTS + 3])
    half_line = lines(base_run)[VARIANTS + 3][:40]
    with (out / "predictions.jsonl").open("a", encoding="utf-8") as torn:
        torn.write(partial_next + half_line)
    code, _, _ = run_cli(*eval_args(out))
    assert code == 0
    assert lines(out) == lines(base_run)
    assert without_peak_memory((out / "predictions.jsonl").read_text(encoding="utf-8")) == without_peak_memory(text)
    for name in ("predictions.jsonl", "config.json", *CSVS):
        assert without_peak_memory((out / name).read_bytes()) == without_peak_memory((base_run / name).read_bytes()), name


@pytest.mark.slow
def test_rerunning_a_finished_run_recomputes_nothing(base_run, eval_args, tmp_path, monkeypatch, run_cli):
    out = copy_run(base_run, tmp_path / "run")

    def fail(*args, **kwargs):
        raise AssertionError("a finished run must not prefill or load the model again")

    from ripplekv.analysis import report

    monkeypatch.setattr(evaluate, "prefill", fail)
    monkeypatch.setattr("ripplekv.engine.models.load_model", fail)
    render = report.render
    monkeypatch.setattr(report, "render", lambda *a, **k: pytest.fail("a current report is not rendered again"))
    config = (out / "config.json").read_text()
    code, stdout, err = run_cli(*eval_args(out, "--seed", "0"))  # the default seed is the run's: nothing differs
    assert code == 0 and "its report is up to date" in err and "kl (score)" in stdout
    assert lines(out) == lines(base_run) and (out / "config.json").read_text() == config
    for name in CSVS:
        assert (out / name).read_text() == (base_run / name).read_text()
    # A report older than its predictions (lines appended after it), or one missing a file, is rendered again.
    for stale in ("predictions.jsonl", "summary.md"):
        if stale == "summary.md":
            (out / stale).unlink()
        else:
            (out / stale).touch()
        rendered = []
        monkeypatch.setattr(report, "render", lambda *a, seen=rendered, **k: seen.append(1) or render(*a, **k))
        code, _, err = run_cli(*eval_args(out))
        assert code == 0 and "re-rendering the report" in err and rendered == [1], stale
        assert (out / "summary.md").is_file()
        for name in CSVS:
            assert (out / name).read_text() == (base_run / name).read_text()
    # Rendered without figures (RIPPLEKV_PLOTS=0, as the suite runs): figures that would no longer be the
    # report's are not left beside it.
    assert not any((out / name).exists() for name in report.FIGURES)


@pytest.mark.slow
def test_a_memory_budget_no_variant_fits_stops_in_one_line_and_loses_nothing(base_run, eval_args, tmp_path, run_cli):
    """Growing a run by a budget under a --memory-budget too small for any variant: a UserError naming the
    variant and what to raise, before it decodes; the lines already written stay as they were."""
    out = copy_run(base_run, tmp_path / "run")
    before = (out / "predictions.jsonl").read_bytes()
    code, _, err = run_cli(*eval_args(out, "--budget", "48", "--memory-budget", "1MB"))
    assert code == 2 and "Traceback" not in err
    assert "at budget 48 needs" in err and "raise --memory-budget to at least" in err
    assert (out / "predictions.jsonl").read_bytes() == before
    code, _, err = run_cli(*eval_args(tmp_path / "other", "--memory-budget", "lots"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--memory-budget must be a size with a unit" in err


@pytest.mark.slow
def test_a_different_config_never_mixes_into_a_run(base_run, eval_args, tmp_path, tokenizer, run_cli):
    out = copy_run(base_run, tmp_path / "run")
    before = (out / "predictions.jsonl").read_bytes()
    args = eval_args(out)
    args[args.index("--target-tokens") + 1] = "400"
    code, _, err = run_cli(*args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "target_tokens" in err and "new --out" in err
    code, _, err = run_cli(*eval_args(out, "--seed", "1"))  # other offline samples
    assert code == 2 and "differs in: seed (0 there, 1 now))" in err
    other_model = tmp_path / "other-model"
    from tests.conftest import tiny_llama

    tiny_llama(vocab_size=len(tokenizer), num_hidden_layers=4, hidden_size=32, intermediate_size=64,
               seed=1).save_pretrained(other_model)
    tokenizer.save_pretrained(other_model)
    args = eval_args(out)
    args[args.index("--model") + 1] = str(other_model)
    code, _, err = run_cli(*args)
    assert code == 2 and "model_sha256" in err
    changed = tmp_path / "alloc.csv"
    changed.write_text("layer,multiplier\n0,1.0\n1,1.0\n2,1.0\n3,1.0\n")
    args = eval_args(out)
    args[args.index("--allocation") + 1] = str(changed)
    code, _, err = run_cli(*args)
    assert code == 2 and "allocation_sha256" in err
    assert (out / "predictions.jsonl").read_bytes() == before


@pytest.mark.slow
def test_a_moved_allocation_with_the_same_multipliers_still_grows_the_run(base_run, eval_args, tmp_path, allocation, run_cli):
    """make reproduce builds in a staging folder and moves it: the run must still grow from the moved files."""
    out = copy_run(base_run, tmp_path / "run")
    before = lines(out)
    moved = tmp_path / "moved" / "alloc.csv"
    moved.parent.mkdir()
    shutil.copy(allocation, moved)
    args = eval_args(out)
    args[args.index("--allocation") + 1] = str(moved)
    code, _, err = run_cli(*args)
    assert code == 0, err
    assert lines(out) == before
    assert json.loads((out / "config.json").read_text())["allocation"] == str(moved.resolve())


@pytest.mark.slow
def test_classification_lines_carry_their_classes_so_score_can_rescore_them(tiny_model_dir, tmp_path, run_cli):
    data = tmp_path / "longbench"
    data.mkdir()
    record = {"input": "What is the capital of France?", "context": "Type: LOC\nQuestion: Where is Rome?",
              "answers": ["LOC"], "all_classes": ["LOC", "HUM", "NUM"], "length": 9}
    (data / "trec.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "longbench", "--data-dir", str(data),
                           "--tasks", "trec", "--methods", "snapkv", "--budget", "8", "--out", str(out))
    assert code == 0, err
    assert {tuple(row["all_classes"]) for row in rows(out)} == {("LOC", "HUM", "NUM")}
    code, _, err = run_cli("score", str(out / "predictions.jsonl"), "--out", str(tmp_path / "s.csv"))
    assert code == 0, err
    scored = pd.read_csv(tmp_path / "s.csv").sort_values("method").reset_index(drop=True)
    ours = pd.read_csv(out / "scores.csv").sort_values("method").reset_index(drop=True)
    assert list(scored["method"]) == list(ours["method"]) and (scored["score"] - ours["score"]).abs().max() < 0.01


@pytest.mark.slow
def test_a_second_eval_into_a_busy_run_directory_is_refused(base_run, eval_args, tmp_path, run_cli):
    """Two evals appending to one directory would duplicate lines: the second one stops with one line."""
    import fcntl

    out = copy_run(base_run, tmp_path / "run")
    (out / "predictions.jsonl").write_text("")  # unfinished: the second eval would have work to do
    before = (out / "predictions.jsonl").read_bytes()
    with (out / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = run_cli(*eval_args(out))
    assert code == 2 and "another ripplekv eval is writing to" in err and len(err.strip().splitlines()) == 1
    assert (out / "predictions.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    "change, message",
    [
        (("--budget", "0"), "budget must be a positive integer"),
        (("--methods", "full,nosuch"), "unknown method 'nosuch'"),
        (("--tasks", "nosuch"), "unknown task 'nosuch'"),
        (("--suite", "nosuch"), "Invalid value for '--suite': 'nosuch' is not one of 'offline', 'ruler', 'longbench', 'longbench-e', 'longbench-v2'"),
        (("--batch-size", "0"), "--batch-size"),
    ],
)
def test_bad_input_is_one_line_before_any_model_work(change, message, eval_args, tmp_path, monkeypatch, run_cli):
    def fail(*args, **kwargs):
        raise AssertionError("bad input must fail before loading anything")

    monkeypatch.setattr("ripplekv.engine.models.load_model", fail)
    monkeypatch.setattr("ripplekv.engine.models.load_tokenizer", fail)
    args = eval_args(tmp_path / "run")
    flag, value = change
    if flag in ("--methods", "--tasks", "--suite", "--batch-size"):
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    code, _, err = run_cli(*args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "run" / "predictions.jsonl").exists()


def test_ripplekv_without_allocation_says_how_to_make_one(tiny_model_dir, tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr("ripplekv.engine.models.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--budget", "64",
                           "--out", str(tmp_path / "run"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "ripplekv profile" in err and "ripplekv allocate" in err


def test_an_allocation_for_another_model_fails_before_loading(eval_args, tmp_path, monkeypatch, run_cli):
    wrong = tmp_path / "alloc30.csv"
    wrong.write_text("layer,multiplier\n" + "".join(f"{i},1.0\n" for i in range(30)))
    monkeypatch.setattr("ripplekv.engine.models.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    args = eval_args(tmp_path / "run")
    args[args.index("--allocation") + 1] = str(wrong)
    code, _, err = run_cli(*args)
    assert code == 2 and "30 layers" in err


@pytest.mark.slow
def test_report_regenerates_identical_csvs_from_predictions_alone(base_run, tmp_path, run_cli):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(base_run / "predictions.jsonl", alone / "predictions.jsonl")
    code, out, _ = run_cli("report", str(alone))
    assert code == 0 and "snapkv" in out
    for name in CSVS:
        assert (alone / name).read_text() == (base_run / name).read_text(), name
    for name in ("score_vs_budget.png", "kl_vs_budget.png", "layer_budgets.png", "summary.md"):
        assert (alone / name).is_file()


def test_parse_budgets_accepts_repeats_and_commas():
    assert eval_plan.parse_budgets(["256", "64,128", "64"]) == (64, 128, 256)


def test_a_run_dir_with_nothing_computed_takes_the_new_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_length": 16}))
    assert run_config.check_run_dir(tmp_path, {"max_length": 32}) is None
    (tmp_path / "predictions.jsonl").write_text('{"id": "a"}\n')
    with pytest.raises(UserError, match="differs in: max_length"):
        run_config.check_run_dir(tmp_path, {"max_length": 32})


def test_a_default_changed_since_a_run_was_made_names_the_runs_own_value(tmp_path):
    # a run made when --batch-size defaulted to 16: resuming it says which value to pass, not only the key
    (tmp_path / "config.json").write_text(json.dumps({"batch_size": 16, "methods": ["full"]}))
    (tmp_path / "predictions.jsonl").write_text('{"id": "a"}\n')
    with pytest.raises(UserError, match=rf"differs in: batch_size \(16 there, {EVAL_BATCH_SIZE} now\)\)"):
        run_config.check_run_dir(tmp_path, {"batch_size": EVAL_BATCH_SIZE, "methods": ["full"]})


@pytest.mark.slow
def test_a_run_grows_by_a_budget_and_a_sample_keeping_every_old_line(base_run, eval_args, tmp_path, run_cli):
    """--budget 16 and --limit 2 over a finished run: old lines untouched, only the missing ones added."""
    out = copy_run(base_run, tmp_path / "run")
    args = eval_args(out, "--budget", "16")
    args[args.index("--limit") + 1] = "2"
    code, _, err = run_cli(*args)
    assert code == 0, err
    assert "prefills them again" in err and "wrote:" in err
    old, new = lines(base_run), lines(out)
    assert new[: len(old)] == old
    added = [json.loads(line) for line in new[len(old):]]
    keys = [(r["task"], r["id"], r["method"], r["budget"]) for r in rows(out)]
    assert len(keys) == len(set(keys))  # nothing written twice, the full rows included
    per_old_sample = {(r["method"], r["budget"]) for r in added if r["id"] in {x["id"] for x in rows(base_run)}}
    assert per_old_sample == {(m, 16) for m in METHODS if m != "full"}
    new_samples = {(r["task"], r["id"]) for r in added} - {(r["task"], r["id"]) for r in rows(base_run)}
    assert len(new_samples) == len(TASKS)
    for sample in new_samples:
        variants = {(r["method"], r["budget"]) for r in added if (r["task"], r["id"]) == sample}
        assert variants == {("full", None)} | {(m, b) for m in METHODS if m != "full" for b in (16, *BUDGETS)}
    config = json.loads((out / "config.json").read_text())
    assert config["budgets"] == [16, *BUDGETS] and config["limit"] == 2
    assert all(len(ids) == 2 for ids in config["samples"].values())
    assert set(pd.read_csv(out / "leaderboard.csv")["budget"].dropna()) == {16, *BUDGETS}
    # The run now holds more than the original command asks for: rerunning that command adds nothing.
    before = (out / "predictions.jsonl").read_bytes()
    code, _, err = run_cli(*eval_args(out))
    assert code == 0 and "already done" in err
    assert (out / "predictions.jsonl").read_bytes() == before


@pytest.mark.slow
def test_score_reads_evals_own_predictions(base_run, tmp_path, run_cli):
    """`ripplekv score` on eval output: one row per task x method x budget, equal to the run's scores.csv."""
    code, _, err = run_cli("score", str(base_run / "predictions.jsonl"), "--out", str(tmp_path / "s.csv"))
    assert code == 0, err
    scored = pd.read_csv(tmp_path / "s.csv")
    assert list(scored.columns) == ["dataset", "method", "budget", "n", "score", "metric"]
    ours = pd.read_csv(base_run / "scores.csv").rename(columns={"task": "dataset"})
    merged = scored.merge(ours, on=["dataset", "method", "budget"], suffixes=("", "_eval"), how="outer")
    assert len(merged) == len(scored) == len(TASKS) * VARIANTS
    assert (merged["score"] - merged["score_eval"]).abs().max() < 0.01


@pytest.mark.slow
def test_progress_counts_every_prefilled_and_decoded_token(tiny_model_dir, allocation):
    """The ETA's work units: prompt tokens at prefill, then (1 + variants) x max new tokens of decoding."""
    from ripplekv.engine.models import load_model
    from ripplekv.methods import make_method
    from ripplekv.tasks import get_tasks, load_samples

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    task = get_tasks("offline", ["niah"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=300)[0]
    methods = {name: make_method(name, shared={"allocation": str(allocation)}) for name in ("full", "snapkv", "ripplekv")}
    seen = []
    rows = evaluate.evaluate_sample(model, tokenizer, task, record, methods, (32, 64),
                                    evaluate.SampleSettings(batch_size=2), sid="s",
                                    wanted=evaluate.Wanted([("snapkv", 64), ("ripplekv", 32), ("ripplekv", 64)], False),
                                    progress=lambda kind, units: seen.append((kind, units)))
    assert [(r["method"], r["budget"]) for r in rows] == [("snapkv", 64), ("ripplekv", 32), ("ripplekv", 64)]
    n = rows[0]["prompt_tokens"]
    # The full answer, then every variant at once (divergence decoding runs them as one piece of work).
    assert seen == [("prefill", n), ("decode", 32), ("decode", 3 * 32)]


def test_eta_comes_from_the_time_per_token_of_each_kind_of_work(monkeypatch):
    now = iter([0.0, 10.0, 30.0]).__next__
    clock = progress.WorkClock(prefill_left=3000, decode_left=400)
    clock._now, clock.mark = now, now()
    assert clock.eta() is None
    clock.advance("prefill", 1000)  # 10 s for 1000 prompt tokens
    assert clock.eta() is None  # decoding not timed yet
    clock.advance("decode", 100)  # 20 s for 100 decode tokens
    assert clock.eta() == pytest.approx(2000 * 0.01 + 300 * 0.2)


@pytest.mark.slow
def test_context_only_protocol_compresses_the_context_and_is_recorded(eval_args, tmp_path, run_cli):
    out = tmp_path / "ctx"
    args = eval_args(out, "--protocol", "context-only")
    args[args.index("--tasks") + 1] = "niah"
    code, _, err = run_cli(*args)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["protocol"] == "context-only"
    result = rows(out)
    assert {r["protocol"] for r in result} == {"context-only"}
    for r in result:
        assert r["compressed_tokens"] < r["prompt_tokens"]  # the question is not compressed
        if r["method"] != "full":
            assert r["kept_entries"] == LAYERS * KV_HEADS * r["budget"]
    board = pd.read_csv(out / "leaderboard.csv")
    assert set(board["protocol"]) == {"context-only"}
    code, _, err = run_cli(*eval_args(tmp_path / "bad", "--protocol", "sideways"))
    assert code == 2 and "Invalid value for '--protocol': 'sideways' is not one of 'with-question', 'context-only'" in err


@pytest.mark.slow
def test_a_run_grows_from_another_checkout_but_not_with_other_weights(base_run, eval_args, tmp_path, run_cli):
    """The model is compared by label and weights' fingerprint, not by path: a committed run whose model lay
    elsewhere (another checkout or venv), or that predates the fingerprint, resumes; other weights do not."""
    out = copy_run(base_run, tmp_path / "run")
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    assert config["model_sha256"]
    for change in ({"model_location": "/elsewhere/model"}, {"model_sha256": None}):
        edited = {**config, **change}
        if change.get("model_sha256", "") is None:
            del edited["model_sha256"]
        config_path.write_text(json.dumps(edited))
        code, _, err = run_cli(*eval_args(out))
        assert code == 0, err
    config_path.write_text(json.dumps({**config, "model_sha256": "0" * 64}))
    code, _, err = run_cli(*eval_args(out))
    assert code == 2 and "model_sha256" in err


@pytest.mark.slow
def test_decode_budget_prompt_is_byte_identical_and_total_holds_every_head_at_b(base_run, eval_args, tmp_path, run_cli):
    """`--decode-budget prompt` (the default) writes what a run without the option writes, byte for byte (base_run
    is run with it; test_a_killed_run_... compares a run without it file by file); `total` records the mode and
    the peak entries per head (B: the prompt has more than B tokens) in every line, in config.json and in the
    leaderboard, and a prompt-budget run directory refuses it."""
    same = copy_run(base_run, tmp_path / "prompt")
    assert "decode_budget" not in json.loads((same / "config.json").read_text())

    def total_args(out, *extra):
        args = eval_args(out, "--decode-budget", "total", *extra)
        args[args.index("--methods") + 1] = "full,snapkv,streamingllm,pyramidkv,ripplekv"
        return args

    code, _, err = run_cli(*total_args(same))
    assert code == 2 and "decode_budget" in err and "differs in" in err
    out = tmp_path / "total"
    code, _, err = run_cli(*total_args(out, "--compress-every", "4"))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["decode_budget"], config["compress_every"]) == ("total", 4)
    result = rows(out)
    assert {r["decode_budget"] for r in result} == {"total"}
    for r in result:
        if r["method"] == "full":
            assert r["peak_entries"] == r["prompt_tokens"] + r["new_tokens"] - 1
        else:
            assert r["kept_entries"] == LAYERS * KV_HEADS * r["budget"]
            assert r["peak_entries"] == r["budget"]
    board = pd.read_csv(out / "leaderboard.csv")
    assert set(board["decode_budget"]) == {"total"}
    assert (board.loc[board["method"] != "full", "peak_entries"] == board.loc[board["method"] != "full", "budget"]).all()
    prompt_again = total_args(out)
    at = prompt_again.index("--decode-budget")
    del prompt_again[at : at + 2]
    code, _, err = run_cli(*prompt_again)  # a prompt-budget command never grows a total-budget run
    assert code == 2 and "decode_budget" in err and "differs in" in err
    code, _, err = run_cli(*eval_args(tmp_path / "refused", "--decode-budget", "total"))
    assert code == 2 and "random cannot compress while decoding" in err and "Traceback" not in err


@pytest.mark.slow
def test_aliases_run_once_and_are_named(tiny_model_dir, tmp_path, run_cli):
    """`snapkv,uniform,adakv,snapkv:split=adakv` is two methods: two variants per budget, never ranked
    against themselves, and the names that were aliases are said."""
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", tiny_model_dir, "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", "snapkv,uniform,adakv,snapkv:split=adakv",
                           "--budget", "32", "--budget", "64", "--out", out)
    assert code == 0, err
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert sorted((row["method"], row["budget"]) for row in lines if row["method"] != "full") == [
        ("adakv", 32), ("adakv", 64), ("snapkv", 32), ("snapkv", 64)]
    assert "note: uniform is another name for snapkv" in err
    assert "note: snapkv:split=adakv is another name for adakv" in err
    assert json.loads((out / "config.json").read_text())["methods"] == ["full", "snapkv", "adakv"]


def test_prompts_beyond_the_models_positions_are_one_line_before_loading_weights(tiny_model_dir, tmp_path, monkeypatch,
                                                                                 run_cli):
    short = tmp_path / "short-model"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    monkeypatch.setattr("ripplekv.engine.models.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = run_cli("eval", "--model", str(short), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--methods", "snapkv", "--budget", "64", "--out", str(tmp_path / "run"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "max_position_embeddings=256" in err and "--max-length" in err
    fits = int(err.split("--max-length ")[1].split()[0])
    assert not (tmp_path / "run" / "predictions.jsonl").exists()

    def reached(*args, **kwargs):
        raise UserError("reached the model")

    monkeypatch.setattr("ripplekv.engine.models.load_model", reached)  # with the --max-length named, it fits
    code, _, err = run_cli("eval", "--model", str(short), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--max-length", str(fits), "--methods", "snapkv", "--budget", "64",
                           "--out", str(tmp_path / "run2"))
    assert code == 2 and "reached the model" in err, err
