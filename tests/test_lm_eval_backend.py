"""The lm-evaluation-harness backend: `full` gives lm-eval's own `hf` numbers, a method's log-likelihoods are read
through exactly L x H_kv x B kept entries, a compressed generation is eval's, and mistakes are one line.

The tasks are the shipped examples (examples/lm_eval), their data path pointed at the checkout, on the tiny
random Llama saved with the real tokenizer (`tiny_model_dir`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from ripplekv.errors import UserError  # noqa: E402
from ripplekv.lm_eval_backend import RippleKVLM  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "lm_eval"
TASKS = ["ripplekv_story_mc", "ripplekv_story_gen"]
BUDGET = 16  # the story's prompts are ~130 tokens: a real compression


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The shipped task files with their data paths made absolute (lm-eval reads them relative to its cwd)."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for yaml in EXAMPLES.glob("*.yaml"):
        text = yaml.read_text().replace("examples/lm_eval/", f"{EXAMPLES}/")
        (folder / yaml.name).write_text(text)
    return folder


def evaluate(lm, task_dir, tasks=TASKS, limit=2):
    """lm-eval's own evaluation of `tasks` with `lm`: {task: [(doc_id, filtered responses), ...]}."""
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                      limit=limit, log_samples=True, bootstrap_iters=0)
    return {task: sorted((s["doc_id"], s["filtered_resps"]) for s in samples)
            for task, samples in results["samples"].items()}


def test_full_gives_the_hf_backends_loglikelihoods_and_answers(tiny_model_dir, task_dir):
    from lm_eval.models.huggingface import HFLM

    ours = evaluate(RippleKVLM(model=str(tiny_model_dir), method="full", dtype="float32", device="cpu"), task_dir)
    theirs = evaluate(HFLM(pretrained=str(tiny_model_dir), device="cpu", dtype="float32", batch_size=1), task_dir)
    assert ours.keys() == theirs.keys() == set(TASKS)
    mc_ours, mc_theirs = ours["ripplekv_story_mc"], theirs["ripplekv_story_mc"]
    assert [d for d, _ in mc_ours] == [d for d, _ in mc_theirs] == [0, 1]
    for (_, mine), (_, hf) in zip(mc_ours, mc_theirs):
        assert len(mine) == len(hf) == 4
        for (ll, greedy), (ll_hf, greedy_hf) in zip(mine, hf):
            assert ll == pytest.approx(ll_hf, abs=1e-3) and greedy == greedy_hf
    assert ours["ripplekv_story_gen"] == theirs["ripplekv_story_gen"]
    assert all(text for _, resp in ours["ripplekv_story_gen"] for text in resp)


def _independent_loglikelihood(model, tokenizer, context: str, continuation: str, budget: int) -> tuple[float, int]:
    """The continuation's log-likelihood read through `ripplekv.compress`'s cache by the model's own forward
    (the Python API's path), its first token from a plain full-attention forward of the context."""
    import ripplekv

    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    tokens = whole[len(context_ids):]
    with torch.inference_mode():
        first = torch.log_softmax(model(torch.tensor([context_ids])).logits[0, -1].float(), -1)[tokens[0]]
        cache = ripplekv.compress(model, tokenizer, context_ids, "snapkv", budget)
        n = len(context_ids)
        rest = model(torch.tensor([tokens[:-1]]), past_key_values=cache, use_cache=True,
                     position_ids=torch.arange(n, n + len(tokens) - 1)[None]).logits[0].float()
        rest = torch.log_softmax(rest, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).sum()
    return float(first + rest), cache.kept_entries


def test_multiple_choice_under_a_method_reads_exactly_the_budget(tiny_model_dir, task_dir):
    lm = RippleKVLM(model=str(tiny_model_dir), method="snapkv", budget=BUDGET, dtype="float32", device="cpu")
    config = lm.model.config
    exact = config.num_hidden_layers * config.num_key_value_heads * BUDGET
    results = lm_eval.simple_evaluate(model=lm, tasks=["ripplekv_story_mc"], limit=2, log_samples=True,
                                      bootstrap_iters=0, task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    samples = sorted(results["samples"]["ripplekv_story_mc"], key=lambda s: s["doc_id"])
    # one prefill and compression per context, shared by its four choices, each at exactly L x H_kv x B
    assert len(lm.kept_per_context) == 2
    assert all(kept.sum() == exact for kept in lm.kept_per_context)
    sample = samples[0]
    context = sample["arguments"][0][0]
    for (ll, _), (_, continuation) in zip(sample["filtered_resps"], sample["arguments"]):
        expected, kept = _independent_loglikelihood(lm.model, lm.tokenizer, context, continuation, BUDGET)
        assert kept == exact
        assert ll == pytest.approx(expected, abs=1e-3)
    full = RippleKVLM(model=str(tiny_model_dir), method="full", dtype="float32", device="cpu")
    full_ll = full.loglikelihood([SimpleNamespace(args=sample["arguments"][0])])[0][0]
    assert full_ll != pytest.approx(sample["filtered_resps"][0][0], abs=1e-4)  # the budget did change what was read


def test_a_compressed_generation_is_evals(tiny_model_dir):
    import ripplekv

    lm = RippleKVLM(model=str(tiny_model_dir), method="snapkv", budget=BUDGET, dtype="float32", device="cpu")
    context = (EXAMPLES / "story_gen.jsonl").read_text().split('"passage": "')[1].split('"')[0]
    ours = lm.generate_until([SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 8}))])[0]
    rows = ripplekv.generate(lm.model, lm.tokenizer, context, methods="snapkv", budgets=BUDGET, chat=False,
                             max_new_tokens=8)
    compressed = next(row for row in rows if row.method == "snapkv")
    assert lm.kept_per_context[0].sum() == compressed.kept_entries
    assert ours == compressed.text and ours


def test_rolling_loglikelihood_is_refused_in_one_line(tiny_model_dir):
    lm = RippleKVLM(model=str(tiny_model_dir), method="snapkv", budget=BUDGET, device="cpu")
    with pytest.raises(UserError, match="loglikelihood_rolling"):
        lm.loglikelihood_rolling([SimpleNamespace(args=("some text",))])


@pytest.mark.parametrize("model_args, message", [
    (["method=nosuch,budget=64"], "unknown method 'nosuch'"),
    (["method=snapkv,budget=0"], "budget must be a positive integer"),
    (["method=snapkv", "budget=abc"], "budget must be a positive integer"),  # lm-eval's space-separated form
    (['{"method": "snapkv", "budget": -1}'], "budget must be a positive integer"),  # and its JSON form
    (["method=oracle,budget=64"], "reads the full cache's answer"),
    (["method=snapkv,budget=64,nosuch=3"], "nosuch"),
])
def test_a_bad_method_or_budget_is_one_line(run_cli, model_args, message):
    code, out, err = run_cli("lm-eval", "--model_args", *model_args, "--tasks", "ripplekv_story_mc")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.slow
def test_the_bundled_model_runs_a_local_task_under_snapkv_at_64(run_cli, task_dir, tmp_path):
    """The issue's command: the shipped multiple-choice task, SnapKV at B=64, the bundled model (one document),
    lm-eval's results JSON written. The one test of a whole run: lm-eval's command line indexes all of its
    built-in tasks first (tens of seconds on a busy machine), which the tests above leave out."""
    import json

    code, out, err = run_cli("lm-eval", "--model_args", "method=snapkv,budget=64", "--tasks", "ripplekv_story_mc",
                             "--include_path", task_dir, "--limit", "1", "--device", "cpu",
                             "--output_path", tmp_path / "out")
    assert code in (0, None), err
    (written,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["config"]["model"] == "ripplekv"
    assert results["config"]["model_args"] == {"method": "snapkv", "budget": 64}
    assert results["results"]["ripplekv_story_mc"]["acc,none"] in (0.0, 1.0)


def test_a_method_on_the_shipped_allocation_passes_the_check(monkeypatch, tmp_path):
    """`method=ripplekv` on the default (bundled) model reads the allocation shipped for it, as eval does."""
    from ripplekv.lm_eval_backend import check_model_args, chosen_method

    monkeypatch.chdir(tmp_path)  # no `ripplekv allocate` output here: the shipped one is the default
    picked, budget = chosen_method("ripplekv", 64, bundled=True)
    assert picked.label == "ripplekv" and budget == 64
    assert picked.describe()["allocator"]["allocation"].endswith("smollm2-135m.csv")
    assert check_model_args("method=ripplekv,budget=64") == {"method": "ripplekv", "budget": 64}


@pytest.mark.parametrize("args, message", [
    (["--model_args", "method=snapkv,budget=64,bits=4"], "model_args bits= applies to none of the chosen methods"),
    (["--model_args", "method=routed,budget=64"], "as model_args route="),
    (["--model_args", "method=snapkv", "--include_path", "/no/such/folder"], "--include_path /no/such/folder is not a folder"),
])
def test_a_mistake_names_lm_evals_own_arguments_in_one_line(run_cli, args, message):
    code, _, err = run_cli("lm-eval", *args, "--tasks", "ripplekv_story_mc")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not any(flag in lines[0] for flag in ("--bits", "--route", "--methods", "--budget"))


@pytest.mark.slow
def test_an_unknown_task_or_a_data_path_read_elsewhere_is_one_line(tiny_model_dir, tmp_path):
    """lm-eval's own failures a user meets first (an unknown task; the shipped example run outside the checkout,
    whose data path is relative to it) are one line, exit 2. Slow: lm-eval indexes its built-in tasks first."""
    model = f"model={tiny_model_dir},method=snapkv,budget=16"
    for args, message in [(["--tasks", "no_such_task"], "Tasks not found: no_such_task"),
                          (["--tasks", "ripplekv_story_mc", "--include_path", str(EXAMPLES)],
                           "a task's data_files path is read relative to the folder lm-eval runs in")]:
        # a process of its own each: lm-eval's log handlers keep the stderr of the first in-process call
        done = subprocess.run([sys.executable, "-m", "ripplekv", "lm-eval", "--model_args", model, *args, "--limit", "1",
                               "--device", "cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stderr.splitlines() if line.startswith("error:") or "Traceback" in line]
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
