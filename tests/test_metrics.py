"""LongBench scoring: parity with the official scorer, ROUGE-L equal to rouge 1.0.1 without its crash,
and the scorer rules (first-line cut, best answer, buckets, unknown datasets)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv.errors import UserError
from ripplekv.metrics import answers as answer_metrics
from ripplekv.metrics import rouge as rouge_metrics
from ripplekv.metrics import scoring as M

# Outputs of the official LongBench scorer on public cases, committed so a fresh clone checks parity.
CASES_PATH = Path(__file__).parent / "data" / "longbench_metric_cases.jsonl"


def _parity_cases():
    """One pytest param per line of the official scorer's outputs."""
    params = []
    with CASES_PATH.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                case = json.loads(line)
                kind = "agg" if case.get("aggregate") else "sample"
                params.append(pytest.param(case, id=f"L{number}-{case['dataset']}-{kind}"))
    return params


def test_parity_cases_cover_every_dataset():
    """The committed cases exercise every LongBench metric, so parity is not claimed on a subset."""
    covered = {json.loads(line)["dataset"] for line in CASES_PATH.read_text(encoding="utf-8").splitlines() if line.strip()}
    assert {M.metric_for(name) for name in covered} >= {"qa_f1", "qa_f1_zh", "rouge", "rouge_zh", "classification",
                                                        "retrieval", "retrieval_zh", "count", "code_sim"}


@pytest.mark.parametrize("case", _parity_cases())
def test_parity_with_official_scorer(case):
    if not case.get("aggregate"):
        got = 100 * M.score_sample(case["dataset"], case["pred"], case["answers"], case["all_classes"])
        assert got == pytest.approx(case["score"], abs=0.01 + 1e-9)
    elif isinstance(case["score"], dict):  # LongBench-E buckets
        got = M.score_by_length(case["dataset"], case["preds"], case["answers"], case["all_classes"], case["lengths"])
        for bucket, want in case["score"].items():
            if want is None or (isinstance(want, float) and math.isnan(want)):
                assert math.isnan(got[bucket])
            else:
                assert got[bucket] == pytest.approx(want, abs=0.01 + 1e-9)
    else:
        got = M.score_dataset(
            case["dataset"], case["preds"], case["answers"], case["all_classes"], case.get("lengths")
        )
        assert got == pytest.approx(case["score"], abs=0.01 + 1e-9)


# --------------------------------------------------------------------------- ROUGE-L against the package


def _package_rouge_l(hyp: str, ref: str) -> float:
    """What the official LongBench `rouge_score` returns: the package's value, 0 when it raises."""
    from rouge import Rouge

    try:
        return Rouge().get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0


def _random_text(rng: random.Random, n_words: int) -> str:
    vocab = [f"w{i}" for i in range(80)]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def test_long_text_rouge_where_package_crashes():
    rng = random.Random(7)
    hyp, ref = _random_text(rng, 800), _random_text(rng, 800)
    from rouge import Rouge

    with pytest.raises(RecursionError):  # its recursive LCS trace; the official scorer then says 0
        Rouge().get_scores([hyp], [ref], avg=True)
    ours = rouge_metrics.rouge_score(hyp, ref)
    assert 0.5 < ours <= 1.0
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # with room to recurse, the package agrees with us
    try:
        assert ours == Rouge().get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]
    finally:
        sys.setrecursionlimit(old)


def test_very_long_rouge_is_exact_at_its_extremes():
    """3,000-word texts (past the package's recursion limit): a text against itself scores 1, against a
    text sharing no word 0 (the package itself scores both 0 here: it crashes and the official code
    swallows the error)."""
    rng = random.Random(3)
    text = _random_text(rng, 3000)
    assert rouge_metrics.rouge_score(text, text) == pytest.approx(1.0)
    other = " ".join(w.replace("w", "v") for w in text.split())
    assert rouge_metrics.rouge_score(text, other) == 0.0


_WORDS = st.sampled_from(["a", "b", "c", "the", "cat", "Cat", "sat", ".", " . ", "\n", "  ", "。", "x.y"])


@settings(max_examples=250, deadline=None)
@given(hyp=st.lists(_WORDS, max_size=30), ref=st.lists(_WORDS, max_size=30), sep=st.sampled_from([" ", "", "\t"]))
def test_rouge_equals_package_on_short_texts(hyp, ref, sep):
    hyp_text, ref_text = sep.join(hyp), sep.join(ref)
    assert rouge_metrics.rouge_score(hyp_text, ref_text) == _package_rouge_l(hyp_text, ref_text)


def test_rouge_zh_equals_package_on_jieba_words():
    import jieba

    pred, gold = "今天北京的天气很好。我们去公园散步吧", "北京今天天气不错，我们去公园走走"
    want = _package_rouge_l(" ".join(jieba.cut(pred)), " ".join(jieba.cut(gold)))
    assert rouge_metrics.rouge_zh_score(pred, gold) == want > 0


def test_rouge_empty_prediction_is_zero():
    assert rouge_metrics.rouge_score("", "some reference.") == 0.0
    assert rouge_metrics.rouge_score("...", "some reference.") == 0.0  # only separators: no sentence at all


# --------------------------------------------------------------------------- scorer rules


TREC_CLASSES = ["Speed", "Word with a special property", "Individual"]


def test_first_line_cut_for_few_shot_datasets():
    assert M.score_sample("trec", "\n\nSpeed\nIndividual", ["Speed"], TREC_CLASSES) == 1.0
    assert M.score_sample("trec_e", "Speed\nIndividual", ["Speed"], TREC_CLASSES) == 1.0
    assert M.score_sample("triviaqa", "Paris\nLondon", ["London"]) == 0.0
    assert M.score_sample("triviaqa", "\nLondon\nParis", ["London"]) == 1.0
    # other datasets keep the whole prediction
    assert M.score_sample("hotpotqa", "Paris\nLondon", ["London"]) == pytest.approx(2 / 3)


def test_best_answer_wins():
    assert M.score_sample("narrativeqa", "Max Carl", ["nothing here", "Max Carl", "Max"]) == 1.0
    assert M.score_sample("narrativeqa", "Max Carl", ["Max", "zzz"]) == pytest.approx(2 / 3)
    assert M.score_sample("narrativeqa", "Max Carl", []) == 0.0


def test_unknown_dataset_lists_known_ones():
    with pytest.raises(UserError, match=r"unknown dataset 'nope'.*narrativeqa.*niah_multikey"):
        M.metric_for("nope")
    with pytest.raises(UserError, match="unknown dataset"):
        M.score_sample("nope", "x", ["x"])


def test_dataset_table_covers_longbench_e_and_offline_tasks():
    assert M.metric_for("gov_report_e") == "rouge"
    assert M.metric_for("repobench-p_e") == "code_sim"
    assert {M.metric_for(t) for t in ("hotpotqa", "squad")} == {"qa_f1"}
    assert M.metric_for("passage_retrieval") == "retrieval"
    assert M.metric_for("passage_count") == "count"
    assert M.metric_for("niah") == M.metric_for("niah_multikey") == "string_match"
    assert M.metric_for("code_completion") == "code_sim"


def test_classification_keeps_official_list_walk_quirk():
    classes = ["a", "ab", "abc"]
    # official: 'a' is dropped, 'ab' is then skipped by the list walk and survives -> 1/2, not 1
    assert answer_metrics.classification_score("abc", "abc", all_classes=classes) == 0.5
    assert answer_metrics.classification_score("Organ of body", "Organ of body", all_classes=["Organ of body", "Color"]) == 1.0
    with pytest.raises(UserError, match="all_classes"):
        M.score_sample("trec", "Speed", ["Speed"], None)


def test_string_match_is_share_of_needles():
    assert M.score_sample("niah", "the code is 4711.", ["4711"]) == 1.0
    assert M.score_sample("niah", "the code is 4712.", ["4711"]) == 0.0
    assert M.score_sample("niah_multikey", "k1 then k3", ["k1", "k2", "k3", "k4"]) == 0.5


def test_code_sim_skips_comment_and_fence_lines():
    pred = "```python\n# say why\n// nope\n    return x\n"
    assert answer_metrics.code_sim_score(pred, "    return x") == 1.0
    assert answer_metrics.code_sim_score("# only a comment", "return x") == 0.0


def test_retrieval_and_count():
    assert answer_metrics.retrieval_score("Paragraph 3 or Paragraph 4", "Paragraph 3") == 0.5
    assert answer_metrics.retrieval_zh_score("段落3", "段落3") == 1.0
    assert answer_metrics.count_score("There are 21 unique paragraphs.", "21") == 1.0
    with pytest.raises(UserError, match="paragraph id"):
        answer_metrics.retrieval_score("3", "three")


def test_dataset_and_length_buckets():
    preds, answers = ["paris", "rome", "paris", "oslo"], [["paris"]] * 4
    assert M.score_dataset("hotpotqa_e", preds, answers, None) == 50.0
    buckets = M.score_by_length("hotpotqa_e", preds, answers, None, [100, 3999, 4000, 7999])
    assert buckets["0-4k"] == 50.0 and buckets["4-8k"] == 50.0
    assert math.isnan(buckets["8k+"])  # empty bucket, as np.mean([]) in the official scorer
    assert M.score_dataset("narrativeqa", ["paris rome", "oslo"], [["paris"], ["oslo"]], None) == 83.33
    with pytest.raises(UserError):
        M.score_dataset("narrativeqa", [], [], None)


# --------------------------------------------------------------------------- rouge-score (Google) beside the official ROUGE


def test_rouge_score_option_matches_hand_computed_rouge_l():
    # rouge-score's README example: LCS "the quick brown jumps the" = 5 of 8 predicted and 9 reference
    # tokens, F1 = 2 * 5 / (8 + 9).
    pred, gold = "The quick brown dog jumps on the log.", "The quick brown fox jumps over the lazy dog"
    assert M.score_sample("gov_report", pred, [gold], rouge="rouge-score") == pytest.approx(10 / 17)
    # Lower-casing and the Porter stemmer: cats->cat, running/run->run; "were" and "was" differ.
    # LCS "the cat run" = 3 of 4 and 4 -> 0.75; the official scorer (case-sensitive, no stemming) finds no common word.
    assert M.score_sample("qmsum", "the cats were running", ["The cat was run"], rouge="rouge-score") == 0.75
    assert M.score_sample("qmsum", "the cats were running", ["The cat was run"]) == 0.0


def test_rouge_score_option_on_chinese_uses_jieba_words():
    # jieba: 我们/去/公园 vs 我们/去/公园/散步 -> LCS 3 of 3 and 4, F1 = 6/7 (the package's own
    # tokenizer keeps only a-z0-9 and would find nothing).
    assert M.score_sample("vcsum", "我们去公园", ["我们去公园散步"], rouge="rouge-score") == pytest.approx(6 / 7)


def test_rouge_option_leaves_other_metrics_alone_and_rejects_unknown_names():
    assert M.score_sample("hotpotqa", "Paris\nLondon", ["London"], rouge="rouge-score") == pytest.approx(2 / 3)
    assert M.metric_label("gov_report_e", "rouge-score") == "rouge:rouge-score"
    assert M.metric_label("hotpotqa", "rouge-score") == "qa_f1"
    with pytest.raises(UserError, match="--rouge must be one of official, rouge-score"):
        M.score_sample("gov_report", "x", ["x"], rouge="rouge2")


def test_rouge_score_without_its_package_says_how_to_install_it(monkeypatch):
    """Google's rouge-score is an extra: without it, asking for it is one line naming the extra."""
    import importlib.util

    from ripplekv.metrics import rouge as rouge_metrics

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rouge_score" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'ripplekv\[rouge\]'"):
        rouge_metrics.check_rouge("rouge-score")
    assert rouge_metrics.check_rouge("official") == "official"  # the default needs nothing extra
