"""The Python API: a cache from `ripplekv.compress` drives a plain `model.generate` to the tokens our own
decoder (and `ripplekv eval`) produces, holds only the entries it keeps, and mistakes raise UserError
with the CLI's message. Tiny random models, except where the bundled model is the point (slow)."""

from __future__ import annotations

import csv
import hashlib
import json
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import ripplekv
from ripplekv.cli.options import flag
from ripplekv.engine.decode import greedy_decode
from ripplekv.engine.prefill import prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method, method_names
from tests.conftest import tiny_llama

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "eval"


def _ids(n: int, seed: int = 1, vocab: int = 101) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generated(model, cache, new_tokens: int, input_ids=None, **kwargs) -> list[int]:
    start = cache.prompt_length
    ids = cache.input_ids if input_ids is None else input_ids
    out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **kwargs)
    return out[0, start:].tolist()


@pytest.mark.parametrize("spec", ["snapkv", "adakv", "gracekv", "full"])
def test_model_generate_with_a_compressed_cache_gives_our_decoders_tokens(tiny_model, spec):
    ids = _ids(300)
    cache = ripplekv.compress(tiny_model, None, ids, method=spec, budget=48)
    state = prefill(tiny_model, ids)
    ours = greedy_decode(tiny_model, state, [make_method(spec).compress(state, 48)], 12)[0]
    assert _generated(tiny_model, cache, 11) == ours
    layers, heads = tiny_model.config.num_hidden_layers, tiny_model.config.num_key_value_heads
    assert cache.kept_entries == layers * heads * (300 if spec == "full" else 48)
    # Reused after rewind(); and transformers' older keyword reaches the same attention.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        again = tiny_model.generate(cache.rewind().input_ids, past_key_values=cache, max_new_tokens=11,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    assert again[0, 300:].tolist() == ours


def test_a_question_read_through_a_compressed_context_is_eval_context_only():
    model = tiny_llama()
    context, question = _ids(250, seed=2), _ids(9, seed=3)
    cache = ripplekv.compress(model, None, torch.tensor([context]), method="snapkv", budget=40)
    fed = torch.cat([cache.prompt_ids, torch.tensor([question])], dim=1)
    state = prefill(model, context)
    expected = greedy_decode(model, state, [make_method("snapkv").compress(state, 40)], 10, prefix=question)[0]
    assert _generated(model, cache, 10, input_ids=fed)[len(question):] == expected


def test_the_compressed_cache_holds_only_its_padded_budget_in_bytes():
    """Measured on the tensors' storage: per-head lengths are real, not a mask over the whole prompt."""
    model = tiny_llama(num_hidden_layers=3)
    n, budget = 600, 40
    layers, heads = 3, model.config.num_key_value_heads
    dim = model.config.hidden_size // model.config.num_attention_heads
    full = ripplekv.compress(model, None, _ids(n), method="full", budget=budget)
    masked_bytes = layers * heads * n * dim * 2 * 4  # what a keep-mask over the full cache holds (float32 K and V)
    assert full.prompt_bytes() == masked_bytes
    uniform = ripplekv.compress(model, None, _ids(n), method="snapkv", budget=budget)
    assert uniform.prompt_bytes() == layers * heads * budget * dim * 2 * 4
    ada = ripplekv.compress(model, None, _ids(n), method="adakv", budget=budget)
    assert bool((ada.counts != ada.counts[:, :1]).any()), "AdaKV's heads should keep different counts here"
    assert ada.kept_entries == layers * heads * budget
    longest = ada.counts.max(axis=1)  # each layer pads its heads to the longest
    padded = int(sum(heads * k * (dim * 2 * 4 + 4) for k in longest))  # K, V and the float32 bias
    assert ada.prompt_bytes() <= padded
    assert ada.prompt_bytes() * 5 < masked_bytes


@pytest.mark.parametrize("call, cli_args", [
    (lambda m: ripplekv.compress(m, None, _ids(50), method="nosuch"), ["--methods", "nosuch", "--budget", "64"]),
    (lambda m: ripplekv.compress(m, None, _ids(50), method="snapkv", budget=0), ["--methods", "snapkv", "--budget", "0"]),
    (lambda m: ripplekv.compress(m, None, _ids(50), method="snapkv:windw=8"), ["--methods", "snapkv:windw=8", "--budget", "64"]),
    (lambda m: ripplekv.compress(m, None, _ids(50), method="snapkv", route="r.csv"),
     ["--methods", "snapkv", "--route", "r.csv", "--budget", "64"]),
])
def test_a_callers_mistake_is_a_user_error_with_the_clis_message(call, cli_args, tiny_model_dir, run_cli, tmp_path):
    with pytest.raises(UserError) as raised:
        call(tiny_llama())
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"), *cli_args)
    assert code == 2 and err.strip() == "error: " + " ".join(raised.value.phrased(flag).split())


# A Python caller passed `methods=`, `budgets=`, `allocation=`...: a message names those, never a CLI flag.
CLI_FLAGS = r"--(methods|budget|allocation|bits|kbits|route|protocol|index)\b"


@pytest.mark.parametrize("call, setting", [
    (lambda m, t: ripplekv.generate(m, t, "text", methods=[]), "methods"),
    (lambda m, t: ripplekv.generate(m, t, "text", methods="snapkv", budgets=[]), "budgets"),
    (lambda m, t: ripplekv.generate(m, t, "text", methods="snapkv,snapkv:window=32"), "methods"),
    (lambda m, t: ripplekv.generate(m, t, "text", methods="snapkv", bits=4), "bits"),
    (lambda m, t: ripplekv.generate(m, t, "text", methods="snapkv", protocol="x"), "protocol"),
    (lambda m, t: ripplekv.compress(m, t, _ids(50), method="ripplekv"), "allocation"),
    (lambda m, t: ripplekv.compress(m, t, _ids(50), method="routed"), "route"),
    (lambda m, t: ripplekv.compress(m, t, _ids(50), method="kivi:bits=profile"), "allocation"),
    (lambda m, t: ripplekv.sample_prompt(t, "nosuch", -1), "index"),
])
def test_an_api_mistake_names_the_python_argument_not_a_cli_flag(call, setting, tokenizer):
    import re

    with pytest.raises(UserError) as raised:
        call(tiny_llama(), tokenizer)
    message = str(raised.value)
    assert not re.search(CLI_FLAGS, message) and re.search(rf"\b{setting}\b", message), message
    assert re.search(CLI_FLAGS, raised.value.phrased(flag))  # the CLI still names its flag (same message)


def test_load_model_takes_a_path_and_says_what_a_wrong_one_is(tiny_model_dir, tmp_path):
    model, _ = ripplekv.load_model(Path(tiny_model_dir), device="cpu", dtype="float32")
    assert model.config.num_hidden_layers == 4
    (tmp_path / "weights.bin").write_text("not a model")
    (tmp_path / "x.gguf").mkdir()
    for given, message in [(tmp_path / "weights.bin", "is a file, not a model directory"),
                           (tmp_path / "x.gguf", "model directory .* has no config.json"),
                           (tmp_path / "absent", "does not exist"),
                           (3, "model must be a hub id, a model directory or a .gguf file, not int")]:
        with pytest.raises(UserError, match=message):
            ripplekv.load_model(given)


def test_generate_says_which_quantized_variant_cannot_fit_and_answers_the_rest(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    answers = ripplekv.generate(model, tokenizer, "The harbour had eleven boats. " * 8, "How many?",
                                methods="snapkv,kivi", budgets=[1, 256], max_new_tokens=2)
    by_variant = {(a.method, a.budget): a for a in answers}
    assert set(by_variant) == {("full", None), ("snapkv", 1), ("snapkv", 256), ("kivi", 1), ("kivi", 256)}
    refused = by_variant["kivi", 1]
    assert "over budget 1" in refused.infeasible and refused.text is None and refused.kl is None
    assert all(a.infeasible is None and isinstance(a.text, str) for key, a in by_variant.items() if key != ("kivi", 1))


def test_other_mistakes_raise_user_error_before_model_work():
    model = tiny_llama()
    for bad in ([[1, 2], [3, 4]], [], torch.zeros(4), "   "):
        with pytest.raises(UserError, match="prompt"):
            ripplekv.compress(model, None, bad, method="snapkv")
    with pytest.raises(UserError, match="allocation"):  # ripplekv needs an allocation off the bundled model
        ripplekv.compress(model, None, _ids(50), method="ripplekv")
    with pytest.raises(UserError, match="loaded transformers model"):
        ripplekv.compress("smollm2-135m", None, _ids(50), method="snapkv")
    with pytest.raises(UserError, match="protocol"):
        ripplekv.generate(model, None, "text", protocol="question-first")
    with pytest.raises(UserError, match="methods is empty"):
        ripplekv.generate(model, None, "text", methods=[])
    with pytest.raises(UserError, match="unknown option"):
        ripplekv.method("pyramidkv", betta=3)


def test_a_cache_given_to_generate_twice_rewinds_itself():
    """A second `model.generate(cache.input_ids, cache=cache)` answers as the first (the prompt is not appended
    again), and a full sequence that continues the answer reads on from the compressed prompt."""
    model = tiny_llama()
    cache = ripplekv.compress(model, None, _ids(300), method="snapkv", budget=48)
    first = _generated(model, cache, 8)
    length = cache.get_seq_length()
    assert _generated(model, cache, 8) == first and cache.get_seq_length() == length
    follow = torch.cat([cache.input_ids, torch.tensor([first[1:] + [5, 6]])], 1)
    continued = _generated(model, cache, 4, input_ids=follow)
    assert continued[: len(first) + 2] == first + [5, 6] and len(continued) == len(first) + 2 + 4
    again = _generated(model, cache.rewind(), 4, input_ids=follow)
    assert again == continued


def test_every_argument_is_checked_with_one_line():
    import numpy as np

    model = tiny_llama()
    cases = [
        (lambda: ripplekv.compress(model, None, None, method="snapkv"), "prompt must be text, token ids or a Prompt"),
        (lambda: ripplekv.compress(model, None, _ids(20) + [101], method="snapkv"), "token id 101 is outside the model's vocabulary"),
        (lambda: ripplekv.compress(model, None, [-1] + _ids(20), method="snapkv"), "token id -1 is outside"),
        (lambda: ripplekv.compress(model, None, [1.5, 2.0], method="snapkv"), "prompt ids must be"),
        (lambda: ripplekv.compress(model, None, object(), method="snapkv"), "prompt must be text"),
        (lambda: ripplekv.compress(model, None, "some text", method="snapkv"), "pass the model's tokenizer"),
        (lambda: ripplekv.generate(model, None, "some text", methods="snapkv"), "pass the model's tokenizer"),
        (lambda: ripplekv.compress(model, None, _ids(20), method="snapkv", budget=0), "budget must be a positive integer"),
        (lambda: ripplekv.compress(model, None, _ids(20), method="snapkv", budget="64"), "budget must be a positive integer"),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message):
            call()
    cache = ripplekv.compress(model, None, _ids(80), method="snapkv", budget=np.int64(32))
    assert cache.budget == 32 and type(cache.budget) is int


def test_generate_checks_its_numbers_as_the_cli_does(tiny_model_dir):
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for kwargs, message in [({"batch_size": "8"}, "batch_size must be a positive integer, got '8'"),
                            ({"batch_size": 0}, "batch_size must be a positive integer"),
                            ({"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer"),
                            ({"budgets": [16, 0]}, "budget must be a positive integer"),
                            ({"answers": "eleven"}, "answers must be a list of strings")]:
        with pytest.raises(UserError, match=message):
            ripplekv.generate(model, tokenizer, "The harbour had eleven boats. " * 5, "How many?", methods="snapkv",
                              **{"max_new_tokens": 2, **kwargs})
    answers = ripplekv.generate(model, tokenizer, "The harbour had eleven boats. " * 5, "How many?", methods="snapkv",
                                budgets=np.int64(16), batch_size=np.int64(2), max_new_tokens=np.int64(2))
    assert [a.budget for a in answers] == [None, 16]


def test_generate_answers_every_variant_from_one_prefill(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ripplekv.pipeline import evaluate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefills = []
    real = evaluate.prefill
    monkeypatch.setattr(evaluate, "prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    context = "The harbour master counted eleven boats at dawn. " * 20
    answers = ripplekv.generate(model, tokenizer, context, "How many boats?", methods="snapkv,streamingllm",
                                budgets=[16, 32], max_new_tokens=6, answers=["eleven"])
    assert len(prefills) == 1
    assert [(a.method, a.budget) for a in answers] == [("full", None), ("snapkv", 16), ("snapkv", 32),
                                                       ("streamingllm", 16), ("streamingllm", 32)]
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert [a.kept_entries for a in answers[1:]] == [layers * heads * b for b in (16, 32, 16, 32)]
    assert answers[0].kl == 0.0 and answers[0].agreement == 1.0 and all(a.score is not None for a in answers)
    for a in answers[1:]:  # agreement counts whole tokens of the full answer; a disagreement moved the distribution
        assert a.agreement * answers[0].new_tokens == pytest.approx(round(a.agreement * answers[0].new_tokens))
        assert a.kl > 0 if a.agreement < 1 else (a.text, a.new_tokens) == (answers[0].text, answers[0].new_tokens)
    only_context = ripplekv.generate(model, tokenizer, context, "How many boats?", methods="snapkv", budgets=16,
                                     max_new_tokens=4, protocol="context-only")
    assert only_context[0].kept_entries < answers[0].kept_entries and only_context[1].score is None


def test_methods_lists_every_method_with_its_defaults():
    listed = {info.name: info for info in ripplekv.list_methods()}
    assert sorted(listed) == method_names()
    assert listed["snapkv"].options["window"] == 32 and listed["full"].scorer is None
    assert ripplekv.method("snapkv:window=16").label == "snapkv:window=16"


def test_import_ripplekv_stays_cheap():
    code = "import sys, ripplekv; print('torch' in sys.modules, ripplekv.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"


def test_load_run_returns_the_committed_leaderboard():
    run = ripplekv.load_run(RESULTS)
    with open(RESULTS / "leaderboard.csv", newline="") as fh:
        expected = list(csv.DictReader(fh))
    table = run.leaderboard
    assert list(table.columns) == list(expected[0]) and len(table) == len(expected)
    for row, want in zip(table.to_dict("records"), expected):
        for column, text in want.items():
            value = row[column]
            if text == "":
                assert pd.isna(value), (column, value)
            elif isinstance(value, str):
                assert value == text
            elif isinstance(value, (bool, np.bool_)):  # a flag column (fewer_samples) reads back as a bool
                assert str(value) == text, (column, value, text)
            else:
                assert float(value) == float(text), (column, value, text)
    assert str(table["budget"].dtype) == "Int64"
    # The README's claim: RippleKV's KL is below SnapKV's at every budget.
    ripple = table[table["method"] == "ripplekv"]
    assert sorted(ripple["budget"].tolist()) == [64, 128, 256, 512] and (ripple["kl_delta_vs_uniform"] < 0).all()
    lines = (RESULTS / "predictions.jsonl").read_text().splitlines()
    assert len(run.predictions) == len(lines) and run.config["budgets"] == [64, 128, 256, 512]
    assert run.scores is not None and set(run.scores["method"]) == set(table["method"])


def test_load_run_mistakes(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ripplekv.load_run(tmp_path / "nowhere")
    with pytest.raises(UserError, match="has no predictions.jsonl"):
        ripplekv.load_run(tmp_path)
    (tmp_path / "predictions.jsonl").write_text('{"method": "full", "budget": null}\n{"method": "snapkv", "budget": 64}\n')
    run = ripplekv.load_run(tmp_path)
    assert run.leaderboard is None and run.predictions["budget"].tolist()[1] == 64
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="config.json is not a JSON object"):
        ripplekv.load_run(tmp_path)


def test_load_run_names_a_torn_last_line_and_leaves_its_sample_out(tmp_path, capsys):
    """As `report` reads a run killed mid-write: the torn line's sample is left out, and said on stderr."""
    rows = [{"task": "niah", "id": "a", "method": "full", "budget": None}, {"task": "niah", "id": "a", "method": "snapkv", "budget": 64},
            {"task": "niah", "id": "b", "method": "full", "budget": None}]
    (tmp_path / "config.json").write_text(json.dumps({"command": "eval"}))
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                                + '{"task": "niah", "id": "b", "method": "snap')
    with pytest.warns(RuntimeWarning, match="ends in a torn line") as said:  # a warning a caller can catch or filter
        run = ripplekv.load_run(tmp_path)
    assert run.predictions["id"].tolist() == ["a", "a"]
    assert len(said) == 1 and "sample niah/b" in str(said[0].message) and "1 lines of that sample" in str(said[0].message)


# --------------------------------------------------------------------------- the bundled model


def test_load_model_returns_the_model_and_tokenizer_every_command_loads(tiny_model_dir):
    model, tokenizer = ripplekv.load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    assert model.config.num_hidden_layers == 4 and not model.training and next(model.parameters()).dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size


@pytest.fixture(scope="module")
def bundled(bundled_model):
    """What `ripplekv.load_model(device="cpu", dtype="float32")` returns, from the session's one load."""
    return bundled_model[:2]




@pytest.mark.slow
def test_compress_then_generate_gives_the_committed_eval_predictions(bundled):
    """The first sample where SnapKV and RippleKV answer differently at B=128 (results/eval, `make reproduce`)."""
    from ripplekv.engine.decode import stop_tokens

    model, tokenizer = bundled
    config = json.loads((RESULTS / "config.json").read_text())
    rows = [json.loads(line) for line in (RESULTS / "predictions.jsonl").read_text().splitlines()]
    by_sample: dict[str, dict] = {}
    for r in rows:
        if r["budget"] == 128 and r["method"] in ("snapkv", "ripplekv"):
            by_sample.setdefault(r["id"], {})[r["method"]] = r
    sid, wanted = next((sid, pair) for sid, pair in by_sample.items()
                       if len(pair) == 2 and pair["snapkv"]["prediction"] != pair["ripplekv"]["prediction"])
    task, index = wanted["snapkv"]["task"], int(sid.rsplit("-", 1)[1])  # ids: offline-<task>-eval-<index>
    prompt = ripplekv.sample_prompt(tokenizer, task, index, target_tokens=config["target_tokens"],
                                    max_length=config["max_length"], seed=config["seed"])
    assert len(prompt.ids) == wanted["snapkv"]["prompt_tokens"]
    allocation = ROOT / "results" / "allocation.csv"  # the run's own (config.json has its hash)
    assert hashlib.sha256(allocation.read_bytes()).hexdigest() == config["allocation_sha256"]
    stops = stop_tokens(model, tokenizer, prompt.task.stop_at_newline)
    for name in ("snapkv", "ripplekv"):
        cache = ripplekv.compress(model, tokenizer, prompt, method=name, budget=128,
                                  **({"allocation": str(allocation)} if name == "ripplekv" else {}))
        assert cache.kept_entries == wanted[name]["kept_entries"]
        out = model.generate(cache.input_ids, cache=cache, max_new_tokens=prompt.task.max_new_tokens - 1,
                             do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        tokens = out[0, cache.prompt_length:].tolist()
        if stops and any(t in stops for t in tokens):  # generate pads after the stop token; eval stops there
            tokens = tokens[: next(i for i, t in enumerate(tokens) if t in stops) + 1]
        assert len(tokens) == wanted[name]["new_tokens"], name
        assert tokenizer.decode(tokens, skip_special_tokens=True) == wanted[name]["prediction"], name


@pytest.mark.slow
@pytest.mark.parametrize("script", ["compress_and_generate.py", "compare_methods.py"])
def test_the_examples_run(script, bundled, monkeypatch, capsys):
    """Each example runs as a script (its own argv), on the already loaded bundled model."""
    from ripplekv import api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: bundled)
    monkeypatch.setattr(sys, "argv", [script, "--budget", "32"])
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    if script == "compress_and_generate.py":
        assert [line.split(":")[0] for line in out] == ["ripplekv", "snapkv"]
        assert all(f"kept {30 * 3 * 32} of" in line for line in out)
    else:
        assert [line.split()[0] for line in out] == ["full", "snapkv@32", "ripplekv@32"]
