"""The newer corners refuse as the old ones do: an option that changes nothing is refused by the one check every
method family passes (naming what the method takes); route candidates and evict pruners must be what the route
or profile really runs; a mistake in a profile, route, eval, inspect or helper script is one `error:` line, exit 2,
before anything is written; smaller marks (ceilings in `generate`, PyramidInfer's sinks note). The helper
scripts' refusals are in test_script_refusals.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ripplekv.errors import UserError
from ripplekv.methods import make_method
from tests.conftest import StubTokenizer

# --------------------------------------------------------------------------- one option check for every family

@pytest.mark.parametrize("spec, idle, why", [
    ("gracekv:shape=1:slots=fixed", "shape", "slots=curvature only"),
    ("gracekv:depth=4:slots=fixed", "depth", "slots=curvature only"),
    ("pyramidinfer:split=adakv", "split", "same in every KV head"),
    ("tova:split=adakv", "split", "same in every KV head"),
    ("streamingllm:split=adakv", "split", "same in every KV head"),
    ("snapkv:kernel=1:pooling=avg", "pooling", "kernel=1 pools nothing"),
    ("criticalkv:kernel=5:pooling=none", "kernel", "pooling=none uses no kernel"),
    ("dynamickv:kernel=1:pooling=max", "pooling", "kernel=1 pools nothing"),
    ("lava:kernel=1:pooling=avg", "pooling", "kernel=1 pools nothing"),
])
def test_an_option_that_changes_nothing_is_refused_naming_what_the_method_takes(spec, idle, why):
    with pytest.raises(UserError) as caught:
        make_method(spec)
    message = str(caught.value)
    assert f"option {idle} changes nothing here" in message and why in message and "it takes: " in message
    takes = message.split("it takes: ")[1].split(", ")
    assert idle not in takes and takes, message


def test_the_same_options_are_taken_where_they_do_something():
    for spec in ("gracekv:shape=1", "tova:heads=kv:split=adakv", "pyramidkv:split=adakv", "snapkv:kernel=1",
                 "snapkv:pooling=none", "dynamickv:pooling=max", "pyramidinfer:scorer=snapkv:split=adakv"):
        make_method(spec)


def test_a_head_splitter_over_scores_alike_in_every_head_is_refused_as_the_plain_method():
    with pytest.raises(UserError, match=r"allocator adakv only splits .* scorer tova's are the same in every KV head"):
        make_method("adakv:scorer=tova")
    make_method("adakv:scorer=knorm")  # per-head scores: the split chooses


@pytest.mark.parametrize("spec", ["dynamickv:ratio_max=inf", "pyramidkv:beta=inf", "snapkv:window=16:kernel=3",
                                  "ripplekv:multipliers=1/nan/1/1"])
def test_infinite_and_undefined_numbers_are_refused_for_every_option(spec):
    if spec == "snapkv:window=16:kernel=3":
        make_method(spec)  # a control: finite numbers pass
        return
    with pytest.raises(UserError, match="must be a finite number"):
        make_method(spec)


def test_inline_multipliers_follow_an_allocation_files_rule():
    with pytest.raises(UserError, match="option multipliers must be >= 0 with at least one > 0"):
        make_method("ripplekv:multipliers=0/0/0/0")
    with pytest.raises(UserError, match="option multipliers must be >= 0"):
        make_method("ripplekv:multipliers=1/-1/1/1")


@pytest.mark.parametrize("command", [
    ["eval", "--methods", "dynamickv:ratio_max=inf", "--budget", "32"],
    ["eval", "--methods", "ripplekv:multipliers=0/0/0/0", "--budget", "32"],
    ["eval", "--methods", "gracekv:shape=1:slots=fixed", "--budget", "32"],
    ["inspect", "--method", "dynamickv:ratio_max=inf", "--budget", "32"],
])
def test_eval_and_inspect_refuse_before_writing_anything(command, tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "out"
    code, _, err = run_cli(*command, "--model", tiny_model_dir, "--out", out)
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: ") and not out.exists()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    import ripplekv

    return ripplekv.load_model(str(tiny_model_dir))


def test_the_python_api_refuses_an_infinite_option(loaded):
    import ripplekv

    with pytest.raises(UserError, match="ratio_max must be a finite number"):
        ripplekv.generate(*loaded, "text", methods=["dynamickv:ratio_max=inf"])
    with pytest.raises(UserError, match="ratio_max must be a finite number"):
        ripplekv.compress(*loaded, "text", method="dynamickv:ratio_max=inf", budget=8)


# --------------------------------------------------------------------------- routes: what the route really runs

def test_a_route_candidate_must_be_its_scorer_alone_and_named_once():
    from ripplekv.pipeline.route import candidate_methods, check_placement_study

    with pytest.raises(UserError, match=r"names one scorer twice \(snapkv and uniform"):
        candidate_methods(["snapkv", "uniform"])
    with pytest.raises(UserError, match="'pyramidkv' is allocator pyramid .* it would run as snapkv"):
        candidate_methods(["snapkv", "pyramidkv"])
    with pytest.raises(UserError, match="'adakv' is allocator adakv \\(a head split\\)"):
        candidate_methods(["adakv", "h2o"])
    assert [m.label for m in candidate_methods(["snapkv", "snapkv:kernel=3", "h2o"])] == ["snapkv", "snapkv:kernel=3", "h2o"]
    with pytest.raises(UserError, match="placement study over one candidate"):
        check_placement_study(1, 100, 8)
    with pytest.raises(UserError, match="--placement-samples 0 leaves no prompts"):
        check_placement_study(5, 100, 0)
    check_placement_study(1, 0, 0)


def test_a_route_file_naming_a_ceiling_or_an_allocator_is_refused(tmp_path):
    route = tmp_path / "route.csv"
    for named, why in (("allocation-ceiling", "budgets from the full cache's answer"),
                       ("pyramidkv", "budgets spread over layers")):
        route.write_text(f"layer,method\n0,snapkv\n1,{named}\n2,snapkv\n3,h2o\n")
        with pytest.raises(UserError, match=f"line 3: '{named}' is allocator .*{why}"):
            make_method("routed", shared={"route": str(route)})


@pytest.mark.parametrize("args, message", [
    (["--placement-samples", "0"], "--placement-samples 0 leaves no prompts"),
    (["--methods", "snapkv"], "placement study over one candidate"),
    (["--methods", "snapkv,uniform", "--placements", "0"], "names one scorer twice"),
])
def test_route_refuses_in_one_line_before_any_model_work(args, message, tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "route"
    code, _, err = run_cli("route", "--model", tiny_model_dir, "--out", out, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and not out.exists(), err


# --------------------------------------------------------------------------- profiles: options that do something

@pytest.mark.parametrize("args, message", [
    (["--signal", "evict", "--evict-method", "gracekv"], "--evict-method gracekv: its budgets come from one greedy"),
    (["--signal", "evict", "--evict-method", "pyramidkv"], "spreads the budget over layers"),
    (["--signal", "evict", "--evict-method", "lava"], "spreads the budget over layers"),
    (["--signal", "evict", "--evict-method", "dynamickv"], "spreads the budget over layers"),
    (["--signal", "evict", "--evict-method", "oracle"], "is a ceiling"),
    (["--prune-ratio", "0.5"], "--prune-ratio applies with --signal evict only"),
    (["--measure", "kl"], "--measure applies with --signal evict only"),
    (["--signal", "infonce", "--evict-method", "snapkv"], "--evict-method applies with --signal evict only"),
    (["--signal", "evict", "--evict-budget", "64"], "--evict-budget applies to --measure kl"),
    (["--signal", "evict", "--measure", "kl", "--evict-budget", "64", "--prune-ratio", "0.5"], "give one"),
])
def test_profile_options_that_do_nothing_or_contradict_are_one_line(args, message, tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "profile"
    code, _, err = run_cli("profile", "--model", tiny_model_dir, "--out", out, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and not out.exists(), err


def test_an_evict_pruner_keeps_the_same_count_in_every_layer():
    """DepthKV's pruner keeps its ratio in every layer (its head split may move entries between a layer's heads,
    never between layers); a pruner that spreads budgets over layers trips the guard, never a silent profile."""
    from ripplekv.engine.prefill import Requirements, prefill
    from ripplekv.methods.signals.column_sums import COLUMN_SUMS
    from ripplekv.pipeline.taskdrop import kept_count, layer_prunes
    from tests.conftest import tiny_llama

    model = tiny_llama()
    state = prefill(model, torch.randint(0, 101, (120,), generator=torch.Generator().manual_seed(3)), capture_window=32,
                    requirements=Requirements(signals={COLUMN_SUMS}))
    count = kept_count(state.length, 0.6)
    for spec in ("h2o", "snapkv", "adakv", "tova", "knorm"):
        keep = layer_prunes(make_method(spec), state, count)
        assert keep.sum((1, 2)).tolist() == [state.num_kv_heads * count] * state.num_layers, spec
    with pytest.raises(AssertionError, match="entries per layer, not"):
        layer_prunes(make_method("pyramidkv"), state, count)


# --------------------------------------------------------------------------- smaller marks

def test_pyramidinfer_notes_sinks_that_fill_the_budget_as_streamingllm_does():
    from ripplekv.methods.core.spec import degenerate_notes

    notes = degenerate_notes([make_method("pyramidinfer:sinks=64"), make_method("pyramidinfer")], [96, 256])
    assert len(notes) == 1 and notes[0].startswith("note: pyramidinfer:sinks=64 at B=96:")
    assert "sinks (64) fill what its window (32) leaves" in notes[0]


def test_generate_marks_ceiling_answers(loaded):
    import ripplekv

    model, tokenizer = loaded
    answers = ripplekv.generate(model, tokenizer, "The cat was called Marmalade. " * 12, "What was the cat called?",
                                methods=["snapkv", "oracle", "allocation-ceiling"], budgets=[16], max_new_tokens=4)
    marks = {answer.method: answer.ceiling for answer in answers}
    assert marks == {"full": False, "snapkv": False, "oracle": True, "allocation-ceiling": True}
    assert json.dumps([a.ceiling for a in answers])  # a plain bool field


# --------------------------------------------------------------------------- fitted files: refused before any prefill

LUKV_SHIPPED = "src/ripplekv/data/lukv/smollm2-135m-lukv.csv"
KVZAP_SHIPPED = "src/ripplekv/data/kvzap/smollm2-135m-mlp.safetensors"
QFILTER_SHIPPED = "src/ripplekv/data/qfilter/smollm2-135m-qfilter.safetensors"
DUO_SHIPPED = "src/ripplekv/data/duoattention/smollm2-135m.json"


@pytest.mark.parametrize("spec, message", [
    ("lukv", "lukv needs a budget curve for this model"),
    ("kvzap", "kvzap needs a fitted mlp surrogate for this model"),
    (f"lukv:curve={LUKV_SHIPPED}", "was fitted for 30 layers x 3 KV heads; the model has 4 layers x 2 KV heads"),  # another model's file
    (f"kvzap:weights={KVZAP_SHIPPED}", "was fitted for 30 layers x 3 KV heads x 576 hidden size"),
    ("duoattention", "duoattention needs gates fitted for this model; fit them on calibration prompts: ripplekv fit"),
    (f"duoattention:gates={DUO_SHIPPED}", "was fitted for 30 layers x 3 KV heads; the model has 4 layers x 2 KV heads"),
    ("snapkv:quant=kivi:bits=4,kvzap:quant=kivi:bits=4", "kvzap needs a fitted mlp surrogate"),
    ("qfilter", "qfilter needs Q-filters fitted for this model; fit them on calibration prompts: ripplekv fit qfilter"),
    (f"qfilter:weights={QFILTER_SHIPPED}", "was fitted for 30 layers x 3 KV heads; the model has 4 layers x 2 KV heads"),
])
@pytest.mark.parametrize("budget", [8, 64])  # 64: over the prompt, where the curve or surrogate is never read
def test_a_method_without_its_fitted_file_is_refused_before_any_prefill(spec, message, budget, monkeypatch):
    import ripplekv
    from ripplekv.engine import prefill as engine_prefill
    from ripplekv.pipeline import evaluate
    from tests.conftest import tiny_llama

    def no_prefill(*args, **kwargs):
        raise AssertionError("a prefill ran before the refusal")

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the shipped files' paths are the checkout's
    monkeypatch.setattr(engine_prefill, "prefill", no_prefill)
    monkeypatch.setattr(evaluate, "prefill", no_prefill)
    model, prompt = tiny_llama(), list(range(5, 45))
    with pytest.raises(UserError, match=message):
        ripplekv.generate(model, StubTokenizer(), "some words " * 4, methods=spec, budgets=budget, chat=False)
    if "," not in spec:
        with pytest.raises(UserError, match=message):
            ripplekv.compress(model, None, prompt, method=spec, budget=budget)


def test_eval_refuses_a_missing_fitted_file_before_writing(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "out"
    code, _, err = run_cli("eval", "--model", tiny_model_dir, "--methods", "lukv,kvzap", "--budget", "4096",
                           "--limit", "1", "--out", out)
    assert code == 2 and err.count("error:") == 1 and "needs a budget curve" in err and not out.exists(), err
