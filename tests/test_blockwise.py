"""Block-wise prefill (`eval --protocol blockwise`): exact budgets, a bounded cache, one block = whole-prompt prefill."""

from __future__ import annotations

import json

import pytest
import torch

from ripplekv.engine import entries
from ripplekv.engine.blockwise import block_bounds, blockwise_prefill, read_block
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.blockwise import check_blockwise
from tests.conftest import tiny_llama

N, BUDGET, BLOCK = 300, 40, 64
RUNS = ("snapkv", "keydiff", "knorm", "streamingllm", "tova", "random")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.arange(N) % 89 + 5


def test_blocks_are_counted_from_the_end_and_the_first_read_holds_the_budget_and_one_partial_block():
    assert block_bounds(100, 40, 64) == [(0, 100)]  # n <= B + b: one read, the whole prompt
    assert block_bounds(300, 40, 64) == [(0, 44), (44, 108), (108, 172), (172, 236), (236, 300)]
    for length, budget, block in ((1000, 128, 100), (257, 1, 1), (4096, 512, 512)):
        bounds = block_bounds(length, budget, block)
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert budget < bounds[0][1] <= budget + block and all(end - start == block for start, end in bounds[1:])


@pytest.mark.parametrize("spec", RUNS)
def test_every_head_keeps_exactly_the_budget_and_never_held_more_than_budget_plus_block(model, ids, spec):
    method = make_method(spec)
    done = blockwise_prefill(model, ids, method, BUDGET, BLOCK, method.requirements())
    assert done.reads == 5 and done.peak_entries == BUDGET + BLOCK
    assert sum(entry.total() for entry in done.entries) == model.config.num_hidden_layers * 2 * BUDGET  # L x H_kv x B
    for entry in done.entries:
        assert entry.counts.tolist() == [BUDGET, BUDGET]
        for head in entry.positions:  # distinct prompt positions, in order, the prompt's last token always kept
            assert head.tolist() == sorted(set(head.tolist())) and 0 <= int(head[0]) and int(head[-1]) <= N - 1
    if spec != "knorm":  # every scorer but KNorm (window 0) keeps the last block's window
        assert all(int(entry.positions[h, -1]) == N - 1 for entry in done.entries for h in range(2))


@pytest.mark.parametrize("spec", RUNS)
def test_one_block_is_the_whole_prompt_prefill(model, ids, spec):
    method = make_method(spec)
    needs = method.requirements()
    done = blockwise_prefill(model, ids, method, BUDGET, N, needs)
    state = prefill_for(model, ids, needs)
    whole = method.compress(state, BUDGET)
    assert done.reads == 1 and done.peak_entries == N
    assert torch.equal(done.last_logits, state.last_logits)
    for ours, theirs in zip(done.entries, whole):
        assert torch.equal(ours.positions, theirs.positions) and torch.equal(ours.keys, theirs.keys)


def test_a_block_read_through_every_kept_entry_is_the_prefill_of_the_whole_prompt(model, ids):
    """Nothing evicted, the block's keys, values, last logits and window queries are the whole prompt's: positions,
    RoPE and the causal mask over kept entries and the block are right."""
    state = prefill_for(model, ids, Requirements(capture_window=16))
    first = prefill_for(model, ids[:200], Requirements())
    kept = [entries.full(first.keys[layer], first.values[layer]) for layer in range(first.num_layers)]
    read, positions = read_block(model, ids[200:], kept, 200, 16)
    assert torch.allclose(read.last_logits, state.last_logits, atol=1e-4)
    for layer in range(state.num_layers):
        assert torch.allclose(read.keys[layer], state.keys[layer], atol=1e-4)
        assert torch.allclose(read.values[layer], state.values[layer], atol=1e-4)
        assert torch.allclose(read.window_queries(layer, 16), state.window_queries(layer, 16), atol=1e-4)
        assert positions[layer].tolist() == [list(range(N))] * 2


def test_a_block_read_after_evicted_entries_sees_each_kept_entry_and_the_block_causally(model, ids):
    """After an eviction (kept positions no longer 0..m-1) the block reads what the engine's compressed cache gives
    for the same entries (`decode.forward_tokens`, which the context-only protocol reads its question with)."""
    from ripplekv.engine.cache import CompressedCache, CompressedLayer
    from ripplekv.engine.decode import forward_tokens

    first = prefill_for(model, ids[:200], Requirements())
    chosen = torch.zeros(2, 200, dtype=torch.bool)
    chosen[0, ::3], chosen[1, 1::3] = True, True  # 67 of 200 in each head, different ones
    kept = [entries.gather(first.keys[layer], first.values[layer], chosen) for layer in range(first.num_layers)]
    read, positions = read_block(model, ids[200:264], kept, 200, 16)
    cache = CompressedCache([CompressedLayer(e.keys[None], e.values[None], None, 200) for e in kept], 1)
    logits = forward_tokens(model, cache, ids[200:264][None], 200)
    assert torch.allclose(read.last_logits, logits[0, -1], atol=1e-4)
    for layer, entry in enumerate(kept):
        assert torch.allclose(read.keys[layer][:, 67:], cache.layers[layer].keys[0], atol=1e-5)
        assert positions[layer][:, :67].tolist() == entry.positions.tolist()
        assert positions[layer][:, 67:].tolist() == [list(range(200, 264))] * 2


def test_streamingllm_keeps_the_same_positions_block_by_block_as_from_the_whole_prompt(model, ids):
    method = make_method("streamingllm")
    done = blockwise_prefill(model, ids, method, BUDGET, BLOCK, method.requirements())
    whole = method.compress(prefill_for(model, ids, method.requirements()), BUDGET)
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(done.entries, whole))


def test_snapkv_block_by_block_differs_from_the_whole_prompt(model, ids):
    """A later block attends only to what was kept, and each block scores with its own window: not a relabelling."""
    method = make_method("snapkv")
    done = blockwise_prefill(model, ids, method, BUDGET, BLOCK, method.requirements())
    whole = method.compress(prefill_for(model, ids, method.requirements()), BUDGET)
    assert any(not torch.equal(a.positions, b.positions) for a, b in zip(done.entries, whole))


@pytest.mark.parametrize(("spec", "why"), [
    ("pyramidkv", "allocator \\(pyramid\\)"), ("adakv", "allocator \\(adakv\\)"), ("h2o", "scorer \\(h2o\\)"),
    ("expected-attention", "scorer \\(expected-attention\\)"), ("chunkkv", "chunked selection"),
    ("snapkv:merge=kvpress", "not a plain selection"), ("snapkv:quant=kivi:bits=4", "not a plain selection"),
    ("gracekv", "not a plain selection"), ("oracle", "scorer \\(oracle\\)")])
def test_methods_without_a_per_block_reading_are_refused_in_one_line(spec, why):
    with pytest.raises(UserError, match=f"{spec.split(':')[0]}.* cannot run under --protocol blockwise: .*{why}") as err:
        check_blockwise({spec.split(":")[0]: make_method(spec)}, 512)
    assert "\n" not in str(err.value)


def test_a_block_shorter_than_a_window_is_refused():
    with pytest.raises(UserError, match="window \\(32 tokens\\) is longer than a block .*--block-tokens 32"):
        check_blockwise({"snapkv": make_method("snapkv")}, 16)
    with pytest.raises(UserError, match="--block-tokens must be a positive"):
        check_blockwise({"snapkv": make_method("snapkv")}, 0)


def eval_args(model_dir, out, *extra):
    return ["eval", "--model", str(model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
            "--target-tokens", "300", "--methods", "snapkv,streamingllm", "--budget", "32", "--batch-size", "4",
            "--out", str(out), *extra]


def test_eval_blockwise_writes_exact_budgets_and_the_prefill_peak(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli(*eval_args(tiny_model_dir, out, "--protocol", "blockwise", "--block-tokens", "64"))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert json.loads((out / "config.json").read_text())["block_tokens"] == 64
    assert [r["method"] for r in rows] == ["full", "snapkv", "streamingllm"]
    for row in rows[1:]:
        assert row["protocol"] == "blockwise" and row["kept_entries"] == 4 * 2 * 32
        assert row["block_tokens"] == 64 and row["prefill_peak_entries"] == 32 + 64 and row["prefill_reads"] > 1
    assert 0 <= rows[1]["kl"] and rows[0]["kl"] == 0
    code, _, err = run_cli(*eval_args(tiny_model_dir, out, "--protocol", "blockwise", "--block-tokens", "64"))
    assert code == 0 and "already done" in err  # resumed: nothing run again
    code, _, err = run_cli(*eval_args(tiny_model_dir, out, "--protocol", "blockwise", "--block-tokens", "128"))
    assert code == 2 and "block_tokens" in err and "Traceback" not in err  # another block size is another run


def test_eval_refuses_a_method_and_a_stray_block_size_in_one_line(tiny_model_dir, tmp_path, run_cli):
    code, _, err = run_cli(*eval_args(tiny_model_dir, tmp_path / "a", "--protocol", "blockwise", "--methods", "adakv"))
    assert code == 2 and "adakv cannot run under --protocol blockwise" in err and "Traceback" not in err
    code, _, err = run_cli(*eval_args(tiny_model_dir, tmp_path / "b", "--block-tokens", "64"))
    assert code == 2 and "--block-tokens applies only with --protocol blockwise" in err


def test_eval_with_one_block_gives_with_question_lines(tiny_model_dir, tokenizer):
    """A block as long as the prompt: each variant's one read is the with-question prefill and compression, so its
    line is with-question's (its answer, counts and fidelity), from a prefill of its own."""
    from ripplekv.engine.models import load_model
    from ripplekv.methods.core.catalog import build_methods
    from ripplekv.pipeline.evaluate import SampleSettings, evaluate_sample
    from ripplekv.tasks import get_tasks, load_samples

    model, _, _ = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    (task,) = get_tasks("offline", ["niah"])
    (record,) = load_samples(task, tokenizer, limit=1, target_tokens=300)
    methods = build_methods(("snapkv", "keydiff"), {"allocation": None, "route": None})
    lines = {protocol: evaluate_sample(model, tokenizer, task, record, methods, (32,),
                                       SampleSettings(batch_size=4, protocol=protocol, block_tokens=4096), sid="s")
             for protocol in ("with-question", "blockwise")}
    for whole, blocks in zip(*lines.values(), strict=True):
        assert (whole["method"], whole["prediction"], whole["kept_entries"]) == \
            (blocks["method"], blocks["prediction"], blocks["kept_entries"])
        assert blocks["kl"] == pytest.approx(whole["kl"], abs=1e-5)
        if blocks["method"] != "full":
            assert blocks["prefill_reads"] == 1 and blocks["prefill_peak_entries"] == blocks["compressed_tokens"]
