"""One compressed context, many questions: the engine, the protocol's lines, the drop table, resuming."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from ripplekv.engine import questions as engine_questions
from ripplekv.engine.decode import full_reference
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.engine.schedule import Decoding, SampleMemory, Variant, decode_variants
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from tests.conftest import tiny_llama

LAYERS, KV_HEADS = 4, 2


def tokens(length, seed, vocab=101):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def variants_of(names=("snapkv", "streamingllm", "pyramidkv"), budgets=(24, 48)):
    return [Variant(name, budget, make_method(name)) for name in names for budget in budgets]


def counting_builds(monkeypatch) -> list:
    """Every variant build the engine's multi-question path makes, as (label, budget)."""
    made = []
    real = engine_questions.build

    def build(state, variant, counts=None):
        made.append((variant.label, variant.budget))
        return real(state, variant, counts)

    monkeypatch.setattr(engine_questions, "build", build)
    return made


@pytest.mark.parametrize("first_in_window", [False, True])
def test_every_question_from_one_compression_is_that_question_asked_alone(monkeypatch, first_in_window):
    """Each variant is compressed once; each question read through a copy of its cache answers exactly as the
    single-question engine answers it (same tokens, same fidelity), so no question sees another's tokens."""
    model = tiny_llama()
    context = tokens(150, seed=1)
    asked = [tokens(9, seed=2), tokens(12, seed=3), tokens(7, seed=4)]
    if first_in_window:  # the first question is the end of the compressed prompt: it reads nothing more
        context, asked = context + asked[0], [[], *asked[1:]]
    variants = variants_of()
    needs = Requirements.of_all(variant.method for variant in variants)
    state = prefill(model, context, capture_window=32, requirements=needs)
    decoding = Decoding(max_new_tokens=8, batch_size=16)
    made = counting_builds(monkeypatch)
    references = engine_questions.question_references(model, state, asked, 8)
    answered = engine_questions.decode_questions(model, state, references, asked, variants, decoding,
                                                 SampleMemory(model))
    assert sorted(made) == sorted((v.label, v.budget) for v in variants)  # compressed once, whatever k is
    assert len(answered) == len(asked)
    for question, reference, decoded in zip(asked, references, answered):
        alone_reference = full_reference(model, state, 8, prefix=question)
        assert reference.tokens == alone_reference.tokens
        # its log-probs, taken while decoding, are the forced pass's along the same answer up to rounding
        torch.testing.assert_close(reference.logprobs, alone_reference.logprobs, atol=1e-5, rtol=0)
        alone = decode_variants(model, state, reference, variants, decoding, SampleMemory(model), (), question)
        assert [one.tokens for one in decoded] == [one.tokens for one in alone]
        assert [one.fidelity.kl for one in decoded] == pytest.approx([one.fidelity.kl for one in alone], abs=1e-6)
        assert [one.fidelity.agreement for one in decoded] == [one.fidelity.agreement for one in alone]
        for one in decoded:
            assert int(one.counts.sum()) == LAYERS * KV_HEADS * one.variant.budget
    # The questions differ, so their answers do: the check above is not comparing one answer with itself.
    assert len({tuple(reference.tokens) for reference in references}) > 1


@pytest.mark.parametrize("tight", ["memory", "groups"])
def test_groups_split_by_memory_give_the_same_answers(monkeypatch, tight):
    """A tight memory bound cuts the variants into several groups, each built once, and reads the questions one
    at a time; groups of one variant that still read every question together: the numbers do not move."""
    model = tiny_llama()
    context, asked = tokens(120, seed=5), [tokens(6, seed=6), tokens(6, seed=7)]
    variants = variants_of(("snapkv", "streamingllm"), (16, 32))
    state = prefill(model, context, capture_window=32)
    references = engine_questions.question_references(model, state, asked, 6)
    roomy = engine_questions.decode_questions(model, state, references, asked, variants, Decoding(6, 16),
                                              SampleMemory(model))
    made = counting_builds(monkeypatch)
    if tight == "memory":
        monkeypatch.setattr(engine_questions, "variant_room", lambda *args, **kwargs: 2)  # one variant a group
    else:
        def one_each(model, state, lengths, *rest):
            return [[index] for index in range(len(lengths))]

        monkeypatch.setattr(engine_questions, "fidelity_groups", one_each)
    tight = engine_questions.decode_questions(model, state, references, asked, variants, Decoding(6, 16),
                                              SampleMemory(model))
    assert len(made) == len(variants)
    for a, b in zip(roomy, tight):
        assert [one.tokens for one in a] == [one.tokens for one in b]
        assert [one.fidelity.kl for one in a] == pytest.approx([one.fidelity.kl for one in b], abs=1e-6)


def test_questions_are_read_together_not_one_pass_each():
    """All questions go through one forward that reads them through the full cache, then one forced pass per group
    of variants with a row for every (variant, question); decoding steps advance every question at once, so they
    number the longest answer's, not the answers' sum."""
    model = tiny_llama()
    context, asked = tokens(140, seed=9), [tokens(9, seed=10), tokens(5, seed=11), tokens(11, seed=12)]
    variants = variants_of(("snapkv", "streamingllm"), (24,))
    state = prefill(model, context, capture_window=32, requirements=Requirements.of_all(v.method for v in variants))
    passes = []

    def note(module, args, kwargs, out):
        passes.append(tuple(kwargs["input_ids"].shape))

    hook = model.register_forward_hook(note, with_kwargs=True)
    try:
        references = engine_questions.question_references(model, state, asked, 8)
        reading = list(passes)
        passes.clear()
        engine_questions.decode_questions(model, state, references, asked, variants, Decoding(8, 16),
                                          SampleMemory(model))
    finally:
        hook.remove()
    longest = max(len(reference.tokens) for reference in references)
    assert [shape for shape in reading if shape[1] > 1] == [(3, 11)]  # the questions, read together
    assert len(reading) == 1 + longest - 1  # then one decoding step per answer token, nothing forced
    assert [shape for shape in passes if shape[1] > 1] == [(2 * 3, 11 + longest - 1)]  # one group, six rows
    assert len(passes) <= longest  # the forced pass, then at most one step per answer token for every row


def test_a_total_decode_budget_is_refused_by_the_engine():
    model = tiny_llama()
    state = prefill(model, tokens(60, seed=8), capture_window=32)
    references = engine_questions.question_references(model, state, [[1, 2], [3, 4]], 4)
    with pytest.raises(ValueError, match="prompt budgets only"):
        engine_questions.decode_questions(model, state, references, [[1, 2], [3, 4]], variants_of(("snapkv",), (16,)),
                                          Decoding(4, decode_budget="total"), SampleMemory(model))


# --------------------------------------------------------------------------- the drop table


def _frame(changes: dict[str, float], contexts: int = 8, questions: int = 3, seed: int = 0) -> pd.DataFrame:
    """Lines of a multi-question run: per method, KL on the first question drawn around 0.2 and each follow-up
    `changes[method]` higher on average; scores 1 on the first, 0 on the follow-ups for `worse`."""
    rng = np.random.default_rng(seed)
    rows = []
    for task in ("niah_multiquestion", "squad_multiquestion"):
        for c in range(contexts):
            base = 0.2 + 0.05 * rng.random()
            for q in range(1, questions + 1):
                rows.append({"task": task, "id": f"{task}-{c}#q{q}", "context_id": f"{task}-{c}", "question_index": q,
                             "method": "full", "budget": None, "kl": 0.0, "score": 1.0, "agreement": 1.0})
                for method, change in changes.items():
                    noise = 0.01 * rng.standard_normal() if change else 0.0
                    kl = base + (change + noise if q > 1 else 0.0)
                    score = 0.0 if (method == "worse" and q > 1) else 1.0
                    rows.append({"task": task, "id": f"{task}-{c}#q{q}", "context_id": f"{task}-{c}",
                                 "question_index": q, "method": method, "budget": 64, "kl": kl, "score": score,
                                 "agreement": 1.0})
    frame = pd.DataFrame(rows)
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def test_the_drop_table_measures_follow_ups_against_the_first_question_per_context():
    from ripplekv.analysis.follow_ups import (
        follow_up_markdown,
        follow_up_table,
        has_follow_ups,
    )

    frame = _frame({"worse": 0.3, "steady": 0.0})
    assert has_follow_ups(frame)
    table = follow_up_table(frame).set_index("method")
    assert list(table.index) == ["full", "worse", "steady"]  # the full cache first, then the run's order
    worse, steady, full = table.loc["worse"], table.loc["steady"], table.loc["full"]
    assert worse["n"] == 16 and worse["kl_change"] == pytest.approx(0.3, abs=0.02)
    assert worse["kl_change_low"] < worse["kl_change"] < worse["kl_change_high"]
    assert worse["kl_verdict"] == "further" and worse["kl_p_holm"] < 0.05
    assert worse["score_first"] == 100 and worse["score_follow_up"] == 0 and worse["score_change"] == -100
    assert worse["score_verdict"] == "worse"
    assert steady["kl_verdict"] in ("tied", "underpowered") and steady["score_verdict"] in ("tied", "underpowered")
    assert steady["score_change"] == 0 and steady["score_p"] == 1.0
    assert pd.isna(full["kl_p"]) and full["score_change"] == 0  # the reference: its KL is 0 by definition
    # The change is the mean over tasks of per-task means of per-context differences.
    lines = frame[frame["method"] == "worse"]
    per_context = lines.groupby(["task", "context_id"]).apply(
        lambda g: g.loc[g.question_index > 1, "kl"].mean() - g.loc[g.question_index == 1, "kl"].iloc[0])
    assert worse["kl_change"] == pytest.approx(per_context.groupby(level=0).mean().mean())
    text = follow_up_markdown(follow_up_table(frame), "multi-question")
    assert "question-agnostic" in text and "| worse | 64 | 16 |" in text and "further" in text


def test_whose_follow_ups_hold_best_is_named_per_budget_against_the_runner_up_in_sample_and_held_out():
    from ripplekv.analysis.follow_up_best import holding_markdown, holding_section, holding_table
    from ripplekv.analysis.follow_ups import follow_up_table

    frame = _frame({"worse": 0.3, "steady": 0.0})
    worse = follow_up_table(frame).set_index("method").loc["worse"]
    (row,) = holding_table({"multi-question": frame}).itertuples()  # one budget: the steady method, then the other
    assert (row.best, row.runner_up, row.n, row.tasks, row.variant) == ("steady", "worse", 16, 2, "question-agnostic")
    assert row.in_sample == pytest.approx(-worse["kl_change"]) and row.in_sample_p_holm < 0.05
    assert row.in_sample_verdict == "closer" and row.in_sample_low < row.in_sample < row.in_sample_high < 0
    # Each half of the contexts is judged on the pair the other half picked: here the same pair both times.
    assert row.held_out_pairs == "steady vs worse; steady vs worse" and row.held_out_verdict == "closer"
    assert row.held_out == pytest.approx(row.in_sample)
    assert row.runner_up_drop == pytest.approx(worse["kl_change"]) and row.runner_up_drop_verdict == "further"
    assert row.best_drop == 0 and row.best_drop_verdict in ("tied", "underpowered")
    assert (row.best_score, row.runner_up_score, row.full_score) == (100, 0, 100)
    text = holding_markdown(holding_table({"multi-question-first": frame}))
    assert "`steady` 0." in text and "first question in the window" in text and "steady vs worse" in text
    assert "held out" in holding_section(frame, "multi-question").lower()


def test_a_pick_that_holds_on_one_half_only_is_not_called_closer_held_out():
    """Method a holds on the even contexts of each task and b on the odd ones: over all contexts one of them is
    picked and looks closer, but each half judged on the other half's pick finds it further."""
    from ripplekv.analysis.follow_up_best import holding_table

    rows = []
    for task in ("niah_multiquestion", "squad_multiquestion"):
        for c in range(12):
            even = c % 2 == 0
            kl = {"a": 0.1 if even else 0.35, "b": 0.3 if even else 0.11, "c": 0.5}
            for method, value in kl.items():
                for q in (1, 2):
                    rows.append({"task": task, "context_id": f"{task}-{c:02d}", "question_index": q, "method": method,
                                 "budget": 128, "kl": 0.05 if q == 1 else value + 0.001 * c, "score": 1.0})
    (row,) = holding_table({"multi-question": pd.DataFrame(rows)}).itertuples()
    assert (row.best, row.runner_up) == ("b", "a")  # 0.205 against 0.225 over every context
    assert row.in_sample == pytest.approx(-0.02) and row.in_sample_verdict in ("tied", "underpowered")
    assert row.held_out_pairs == "b vs a; a vs b"  # the even half judged on the odd half's pick, then the reverse
    assert row.held_out == pytest.approx(0.22) and row.held_out_verdict == "further" and row.held_out_p_holm < 0.05
def test_a_single_question_run_has_no_drop_table():
    from ripplekv.analysis.follow_ups import has_follow_ups

    frame = _frame({"a": 0.0}, questions=1)
    assert not has_follow_ups(frame) and not has_follow_ups(frame.drop(columns=["context_id", "question_index"]))


# --------------------------------------------------------------------------- resuming


def test_a_torn_write_drops_every_question_of_its_context(tmp_path):
    from ripplekv.runs.files import without_torn_sample
    from ripplekv.runs.resume import existing_lines

    rows = [{"task": "t", "id": f"c{c}#q{q}", "context_id": f"c{c}", "question_index": q, "method": "full",
             "budget": None, "prompt_tokens": 100 + q} for c in (1, 2) for q in (1, 2)]
    torn = b'{"id": "c2#q3", "context_id": "c2", "task": "t", "meth'
    kept = without_torn_sample(tmp_path / "p.jsonl", rows, torn, say=lambda text: None)
    assert [row["id"] for row in kept] == ["c1#q1", "c1#q2"]
    path = tmp_path / "predictions.jsonl"
    path.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in rows) + torn)
    have = existing_lines(tmp_path)  # the context the kill tore is cut off whole, to run again in one piece
    assert set(have) == {("t", "c1")} and have[("t", "c1")]["prompt_tokens"] == 101
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["c1#q1", "c1#q2"]


def test_the_api_refuses_the_multi_question_protocols():
    import ripplekv

    with pytest.raises(UserError, match="protocol"):
        ripplekv.generate(tiny_llama(), None, "some context", "a question?", protocol="multi-question")
