"""The shortest prompts, for every method `ripplekv methods` lists and every allocator and scorer composed.

Prompts of 1, 2 and a few tokens, prompts shorter than a method's observation window (32), pooling kernel (7),
sinks (4), slots, KVzip's chunk or SqueezeAttention's last tokens, at budget 1, 2, n - 1, n and above n: every
method keeps exactly its budget, `L x H_kv x B` entries (the rule of tests/test_budgets.py), or the whole prompt
where the prompt is no longer than the budget, each kept entry a distinct prompt position, and nothing crashes.
The states come from a real prefill of a tiny random Llama, as `ripplekv eval` builds them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import ALLOCATORS, SCORERS, make_method, method_names
from tests.conftest import every_method, method_inputs, satisfy, tiny_llama

LENGTHS = (1, 2, 3, 4, 5, 8, 33, 40)  # 33: one entry before a window of 32; 40: a prefix shorter than kernel 7 + 4 sinks


def budgets_for(length: int) -> list[int]:
    return sorted({1, 2, max(length - 1, 1), length, length + 5})


# Each allocator under SnapKV's scores, and each scorer in one global competition of every layer and head (the
# allocator that asks every scorer for every entry's score, where a uniform split asks only past the window).
# The inputs a component needs are the ones its preset gets (`method_inputs`); the exceptions, with why:
COMPOSITION_INPUTS = {"file": "ripplekv", "compresskv": "compresskv", "router": "routed", "kvzap": "kvzap",
                      "qfilter": "qfilter", "duoattention": "duoattention",
                      "fastkvzip": "fastkvzip"}
NOT_COMPOSED = {"lukv": "LU-KV's budget curve is fitted per scorer: its allocator runs under its own scorer only "
                        "(the lukv preset, covered above)"}
COMPOSITIONS = ([f"snapkv:allocator={name}" for name in sorted(ALLOCATORS) if name not in NOT_COMPOSED]
                + [f"snapkv:allocator=global:scorer={name}" for name in sorted(SCORERS)])


def composed(spec: str, inputs: dict) -> object:
    component = spec.rsplit("=", 1)[1]
    preset = COMPOSITION_INPUTS.get(component)
    return make_method(spec, **(inputs[preset] if preset else {}))


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """Every preset and composition, and one satisfied prefill per prompt length for all of them at once."""
    model = tiny_llama()
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    folder = tmp_path_factory.mktemp("inputs")
    methods = every_method(layers, folder, kv_heads=heads)
    inputs = method_inputs(layers, folder, kv_heads=heads)
    methods.update({spec: composed(spec, inputs) for spec in COMPOSITIONS})
    needs = Requirements.of_all(methods.values())
    states = {n: satisfy(prefill_for(model, torch.arange(n) % 97 + 3, needs)) for n in LENGTHS}
    return methods, states


def check_keeps_budget_or_prompt(method, state, budget: int) -> None:
    length, layers, heads = state.length, state.num_layers, state.num_kv_heads
    counts = torch.as_tensor(method.budgets(state, budget))
    built = method.compress(state, budget)
    kept = torch.stack([layer.counts for layer in built])
    assert kept.tolist() == counts.tolist()
    expected = length if method.is_full else min(budget, length)
    assert int(kept.sum()) == layers * heads * expected
    assert int(kept.max()) <= length
    for layer in built:
        for head in range(heads):
            positions = layer.positions[head][layer.positions[head] >= 0]
            assert len(positions) == int(layer.counts[head]) and all(0 <= p < length for p in positions.tolist())
            if layer.spans is None:  # plain tokens: each a distinct position (a prototype may stand for several)
                assert len(set(positions.tolist())) == len(positions)
            if length <= budget:
                assert sorted(positions.tolist()) == list(range(length))


def check_bytes_or_refused(method, state, budget: int) -> None:
    """Quantized: budget B is bytes, not entries (tests/test_memory_axis.py). Refused in one line where it cannot
    fit (a prompt shorter than KIVI's full-precision residual, under a budget below the prompt); else within the
    budget's bytes, and the whole prompt kept where the prompt is no longer than the budget."""
    from ripplekv.methods.core.quantized import budget_bytes, kept_bytes, stored_as

    if method.infeasible(state, budget):
        with pytest.raises(UserError, match="over budget"):
            method.budgets(state, budget)
        return
    counts = torch.as_tensor(method.budgets(state, budget))
    assert [layer.counts.tolist() for layer in method.compress(state, budget)] == counts.tolist()
    assert kept_bytes(state, counts.numpy(), stored_as(method, state, budget)) <= budget_bytes(state, budget)
    if state.length <= budget:
        assert int(counts.min()) == state.length


@pytest.mark.parametrize("name", method_names() + COMPOSITIONS)
def test_short_prompts_keep_the_budget_or_the_whole_prompt(setting, name):
    methods, states = setting
    method = methods[name]
    for length, state in states.items():
        for budget in budgets_for(length):
            try:
                if getattr(method, "quantizer", None) is not None:
                    check_bytes_or_refused(method, state, budget)
                else:
                    check_keeps_budget_or_prompt(method, state, budget)
            except Exception as failure:
                raise AssertionError(f"{name}: a {length}-token prompt at budget {budget}: {failure!r}") from failure


def test_every_listed_method_is_covered(run_cli):
    """The methods above are the ones `ripplekv methods` prints, read from its table, not a list kept by hand."""
    code, out, _ = run_cli("methods")
    assert code == 0
    table = out.split("─" * 20, 1)[1].split("\nallocators: ", 1)[0]
    listed = {m.group(1) for m in re.finditer(r"^  ([a-z0-9][a-z0-9-]*)\s", table, re.MULTILINE)}
    assert listed == set(method_names())
    # and every allocator and scorer the listing names is composed
    names = re.search(r"allocators: (.+?);\s+scorers: (.+?)\s+\(swap", out.replace("\n", " "))
    assert {n.strip() for n in names.group(1).split(",")} - set(NOT_COMPOSED) == {
        spec.split("=")[1] for spec in COMPOSITIONS if ":scorer=" not in spec}
    assert {n.strip() for n in names.group(2).split(",")} == {
        spec.rsplit("=", 1)[1] for spec in COMPOSITIONS if ":scorer=" in spec}


SHORT_PROMPT_METHODS = ("lava", "dynamickv", "snapkv:allocator=global")  # the ones that crashed on 2 tokens


@pytest.mark.parametrize("spec", SHORT_PROMPT_METHODS)
def test_compress_a_prompt_of_one_and_two_tokens(tiny_model, spec):
    """The Python API on the shortest prompts: the cache holds min(B, n) entries per layer and head, and the
    model generates through it."""
    import ripplekv

    layers, heads = tiny_model.config.num_hidden_layers, tiny_model.config.num_key_value_heads
    for ids in ([5], [5, 9]):
        for budget in (1, 4):
            cache = ripplekv.compress(tiny_model, None, ids, method=spec, budget=budget)
            assert cache.kept_entries == layers * heads * min(budget, len(ids))
            out = tiny_model.generate(cache.input_ids, cache=cache, max_new_tokens=2, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
            assert out.shape[1] == cache.input_ids.shape[1] + 2  # the prompt, its next token, two more


@pytest.mark.slow
def test_generate_eval_and_inspect_on_a_two_token_prompt(tiny_model_dir, tmp_path, run_cli):
    """`ripplekv.generate` and `ripplekv inspect` on a prompt of 2 tokens, and `ripplekv eval` on its shortest
    prompt (2 tokens of the sample in the chat template: no longer than the window of 32), with the methods
    that crashed there, at a budget under and over the prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ripplekv

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    methods = ",".join(SHORT_PROMPT_METHODS)
    answers = ripplekv.generate(model, tokenizer, "Hi there", None, methods=methods, budgets=[1, 8], max_new_tokens=2,
                                chat=False)
    n = len(tokenizer("Hi there", add_special_tokens=False)["input_ids"])
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert n <= 2 and [a.kept_entries for a in answers[1:]] == [layers * heads * min(b, n) for _ in range(3)
                                                               for b in (1, 8)]
    code, _, err = run_cli("eval", "--model", tiny_model_dir, "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--max-length", "2", "--methods", methods, "--budget", "1",
                           "--budget", "8", "--out", tmp_path / "eval")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert max(r["prompt_tokens"] for r in rows) <= 32 and len(rows) == 1 + 3 * 2
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hi there")
    code, _, err = run_cli("inspect", "--model", tiny_model_dir, "--prompt-file", prompt, "--method", "lava",
                           "--budget", "1", "--out", tmp_path / "inspect")
    assert code == 0, err
    assert (tmp_path / "inspect" / "kept.npz").is_file()
