"""The one prefill is the model's own whatever the methods record; selections are a function of the scores."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ripplekv.engine import decode as engine_decode
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.engine.recorders import WINDOW_QUERIES, SampleContext, record_reference
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.core.base import top_indices, top_scored_mask
from ripplekv.methods.kvzip import TOKENIZER
from ripplekv.methods.oracle import REFERENCE_ANSWER
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from ripplekv.methods.signals.query_statistics import QUERY_STATISTICS
from ripplekv.pipeline import evaluate
from tests.conftest import StubTokenizer, tiny_llama

SRC = Path(__file__).resolve().parent.parent / "src" / "ripplekv"
BASE = ("full", "snapkv", "pyramidkv", "streamingllm", "adakv")
RECORDING = ("h2o", "expected-attention", "kvzip", "oracle")  # each asks the prefill for a signal of its own
BUDGETS = (24, 48)


def run_sample(model, tokenizer, task, record, names, monkeypatch):
    """One eval sample with methods `names`: its rows, its prefill state and its full-cache reference."""
    seen = {}
    real_prefill, real_reference = evaluate.prefill, engine_decode.full_reference

    def keep_state(*args, **kwargs):
        seen["state"] = real_prefill(*args, **kwargs)
        return seen["state"]

    def keep_reference(*args, **kwargs):
        seen["reference"] = real_reference(*args, **kwargs)
        return seen["reference"]

    monkeypatch.setattr(evaluate, "prefill", keep_state)
    monkeypatch.setattr(engine_decode, "full_reference", keep_reference)
    methods = {name: make_method(name) for name in names}
    rows = evaluate.evaluate_sample(model, tokenizer, task, record, methods, BUDGETS,
                                    evaluate.SampleSettings(batch_size=4), sid="s")
    return rows, seen["state"], seen["reference"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_methods_that_record_more_leave_the_reference_and_every_other_method_unchanged(tiny_model_dir, dtype,
                                                                                       monkeypatch):
    """H2O's column sums, Expected Attention's statistics, KVzip's tokenizer and the oracle's answer are
    recorded beside the prefill: with or without them in the run, the full cache's tokens and log-probs and
    every other method's kept positions and tokens are bit for bit the same, in float32 and bfloat16."""
    from ripplekv.engine.models import load_model
    from ripplekv.tasks import get_tasks, load_samples

    model, tokenizer, _ = load_model(str(tiny_model_dir), device="cpu", dtype=dtype)
    task = get_tasks("offline", ["niah"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=300)[0]
    plain_rows, plain, plain_ref = run_sample(model, tokenizer, task, record, BASE, monkeypatch)
    rows, state, reference = run_sample(model, tokenizer, task, record, BASE + RECORDING, monkeypatch)
    assert {COLUMN_SUMS, QUERY_STATISTICS} <= set(state.signals) and COLUMN_SUMS not in plain.signals
    assert {r["method"] for r in rows} == set(BASE) | set(RECORDING)
    for layer in range(state.num_layers):
        assert torch.equal(state.keys[layer], plain.keys[layer])
        assert torch.equal(state.values[layer], plain.values[layer])
    assert torch.equal(state.last_logits, plain.last_logits)
    assert reference.tokens == plain_ref.tokens
    assert torch.equal(reference.logprobs, plain_ref.logprobs)
    by_key = {(r["method"], r["budget"]): r for r in rows}
    for row in plain_rows:
        other = by_key[(row["method"], row["budget"])]
        assert other["prediction"] == row["prediction"] and other["new_tokens"] == row["new_tokens"], row["method"]
        assert other["layer_budgets"] == row["layer_budgets"] and other.get("head_budgets") == row.get("head_budgets")
    for name in BASE[1:]:
        method = make_method(name)
        for budget in BUDGETS:
            for mine, theirs in zip(method.compress(state, budget), method.compress(plain, budget)):
                assert torch.equal(mine.positions, theirs.positions), (name, budget)


def test_the_sample_context_reaches_only_the_methods_that_declared_it():
    model = tiny_llama()
    ids = torch.randint(3, 101, (40,), generator=torch.Generator().manual_seed(0))
    context = SampleContext(StubTokenizer(), (3, 4))
    plain = prefill(model, ids, context=context)
    assert set(plain.signals) == {WINDOW_QUERIES}  # nothing declared, nothing else kept
    with pytest.raises(UserError, match="full cache's answer"):
        make_method("oracle").compress(plain, 16)
    needs = Requirements.of_all([make_method("oracle"), make_method("kvzip")])
    assert needs.signals == {REFERENCE_ANSWER, TOKENIZER}
    state = prefill(model, ids, requirements=needs, context=context)
    assert state.signal(TOKENIZER) is context.tokenizer
    with pytest.raises(UserError, match="full cache's answer"):  # declared, but not decoded yet
        make_method("oracle").compress(state, 16)
    record_reference(state, [7, 8])
    assert state.signal("reference_answer").question == (3, 4) and state.signal("reference_answer").tokens == (7, 8)
    record_reference(plain, [7, 8])  # a no-op where no method declared it
    assert set(plain.signals) == {WINDOW_QUERIES}


def test_a_signal_has_one_recorder_and_an_unrecorded_signal_is_one_line(monkeypatch):
    from ripplekv.engine import recorders

    monkeypatch.setattr(recorders, "RECORDERS", dict(recorders.RECORDERS))

    @recorders.register_recorder("my_signal")
    class Mine(recorders.PerLayer):
        pass

    assert recorders.register_recorder("my_signal")(Mine) is Mine  # the same class again (a reload) is fine
    with pytest.raises(ValueError, match="already has a recorder"):

        @recorders.register_recorder(COLUMN_SUMS)
        class Other(recorders.PerLayer):
            pass

    state = prefill(tiny_llama(), torch.arange(3, 40))
    with pytest.raises(UserError, match="did not record the signal 'my_signal'.*Requirements"):
        state.signal("my_signal")
    with pytest.raises(UserError, match="no recorder is registered for the signal 'nobody'"):
        prefill(tiny_llama(), torch.arange(3, 40), requirements=Requirements(signals={"nobody"}))


def test_memo_keys_name_the_function_and_share_its_result():
    state = prefill(tiny_llama(), torch.arange(3, 40))
    calls = []

    def area(side):
        calls.append(side)
        return side * side

    assert state.memo((area, 3), lambda: area(3)) == 9 and state.memo((area, 3), lambda: area(3)) == 9
    assert calls == [3]  # computed once per key
    state.forget()
    assert state.memo((area, 3), lambda: area(3)) == 9 and calls == [3, 3]
    with pytest.raises(TypeError, match="a memo key is a tuple"):
        state.memo(("area", 3), lambda: 9)  # a hand-built string key is refused


def method_data_assignments() -> list[str]:
    """`file:line` for every assignment to an attribute of a prefill state in pipeline/ and api.py."""
    found = []
    for path in sorted([*(SRC / "pipeline").rglob("*.py"), SRC / "api.py"]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and "state" in leaf.value.id:
                        found.append(f"{path.relative_to(SRC).as_posix()}:{node.lineno}: {leaf.value.id}.{leaf.attr}")
    return found


def test_the_pipeline_sets_no_methods_data_on_the_prefill_state():
    """What a scorer reads from the sample (tokenizer, the full answer) reaches it through its requirements
    and the engine's recorders, never through attributes the pipeline sets on the state."""
    assert method_data_assignments() == []


def test_the_state_assignment_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "x.py").write_text("def f(state, t):\n    state.answer, state.prefix = t, []\n"
                                                "    setattr(state, 'tokenizer', t)\n")
    (tmp_path / "api.py").write_text("")
    monkeypatch.setattr("tests.test_recorders.SRC", tmp_path)
    assert method_data_assignments() == ["pipeline/x.py:2: state.answer", "pipeline/x.py:2: state.prefix",
                                         "pipeline/x.py:3: state.?"]


# --------------------------------------------------------------------------- ties


def test_among_equal_scores_the_lowest_position_wins_every_time():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0, 0.0], [5.0] * 7])
    assert top_indices(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2]]
    # max pooling ties whole runs of neighbours: the earliest of a run is kept first
    pooled = torch.nn.functional.max_pool1d(torch.rand(4, 1, 500, generator=torch.Generator().manual_seed(1)), 9,
                                            stride=1, padding=4).view(4, 500)
    mask = top_scored_mask(pooled, 532, 32, 132)
    for head in range(4):
        kept = mask[head, :500].nonzero().flatten()
        threshold = pooled[head, kept].min()
        assert bool((pooled[head] > threshold).le(mask[head, :500]).all())  # everything above the cut is kept
        tied = (pooled[head] == threshold).nonzero().flatten()
        taken = int(mask[head, tied].sum())
        assert mask[head, tied[:taken]].all() and not mask[head, tied[taken:]].any()  # the lowest positions
    assert torch.equal(mask, top_scored_mask(pooled.clone(), 532, 32, 132))


def tied_state():
    """A state whose scores tie everywhere: keys and queries rounded, H2O's sums on a coarse grid."""
    from tests.test_budgets import fake_state

    state = fake_state(3, 160, kv_heads=2, query_heads=4, seed=5)
    state.signals[WINDOW_QUERIES] = [q.round() for q in state.signal(WINDOW_QUERIES)]
    state.keys = [k.round() for k in state.keys]
    state.signals[COLUMN_SUMS] = [a.mul(4).round() for a in state.signal(COLUMN_SUMS)]
    return state


@pytest.mark.parametrize("spec", ["snapkv", "h2o:recent=0:window=8"])
def test_tied_scores_keep_the_lowest_positions_among_equals(spec):
    state = tied_state()
    method, budget = make_method(spec), 40
    masks = method.select(state, budget)
    ties = 0
    for layer in range(state.num_layers):
        scores = method.scorer.scores(state, layer)
        window = state.length - scores.shape[1]
        for head in range(state.num_kv_heads):
            row = scores[head].tolist()
            ranked = sorted(range(len(row)), key=lambda j: (-row[j], j))[: budget - window]
            ties += sum(row[j] == row[ranked[-1]] for j in range(len(row))) > 1
            assert masks[layer, head, : len(row)].nonzero().flatten().tolist() == sorted(ranked)
    assert ties > 0  # the cut falls inside a tie somewhere, or the test proves nothing


@pytest.mark.parametrize("spec", ["snapkv", "adakv", "snapkv:allocator=global", "criticalkv", "defensivekv",
                                  "gracekv", "h2o"])
def test_tied_scores_give_one_kept_set_run_after_run(spec):
    state = tied_state()
    method = make_method(spec)
    first = [e.positions for e in method.compress(state, 40)]
    state.forget()
    again = [e.positions for e in method.compress(state, 40)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
