"""Fuzzing the metric functions: random unicode, empty, Chinese and very long (100k chars) strings never
crash and always score within [0, 1]."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ripplekv.metrics import answers as answer_metrics
from ripplekv.metrics import rouge as rouge_metrics

CHINESE = st.text(alphabet=st.sampled_from(list("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年。，、！？ .")), max_size=120)
TEXT = st.one_of(st.just(""), st.text(max_size=120), CHINESE, st.text(alphabet=" .\n\t", max_size=20))
CLASSES = ["Speed", "Color", "人物", ""]


def check_all(prediction: str, gold: str, number: int) -> None:
    """Every metric on one (prediction, gold) pair, golds shaped the way each metric needs them."""
    scores = [fn(prediction, gold) for fn in (answer_metrics.qa_f1_score, answer_metrics.qa_f1_zh_score, rouge_metrics.rouge_score,
                                              rouge_metrics.rouge_zh_score, answer_metrics.count_score,
                                              answer_metrics.code_sim_score)]
    scores.append(answer_metrics.string_match_score(prediction, [gold, prediction[:3]]))
    scores.append(answer_metrics.classification_score(prediction, (CLASSES + [gold])[number % 5], all_classes=CLASSES + [gold]))
    scores.append(answer_metrics.retrieval_score(prediction, f"Paragraph {number}"))
    scores.append(answer_metrics.retrieval_zh_score(prediction, f"段落{number}"))
    for score in scores:
        assert 0.0 <= score <= 1.0, (prediction, gold, scores)


@settings(max_examples=10_000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(prediction=TEXT, gold=TEXT, number=st.integers(0, 99))
def test_metrics_never_crash_and_stay_in_range(prediction, gold, number):
    check_all(prediction, gold, number)


def _long(kind: str, seed: int) -> str:
    rng = random.Random(seed)
    if kind == "chinese":
        return "".join(rng.choice("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年。，") for _ in range(100_000))
    if kind == "unicode":
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(100_000))
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta.", "x")) for _ in range(20_000))[:100_000]


@pytest.mark.parametrize("kind", ["chinese", "unicode", "english"])
def test_100k_character_texts_stay_in_bounded_memory_and_range(kind):
    """Two 100k-character texts: ROUGE-L's LCS table would need tens of GiB; it must neither crash nor allocate it."""
    check_all(_long(kind, 1), _long(kind, 2), 7)  # jieba alone takes ~2.5 s per 100k Chinese characters


def test_rouge_over_the_memory_bound_scores_zero_like_the_official_scorer():
    words = " ".join(f"w{i}" for i in range(6000))
    assert rouge_metrics.rouge_score(words, words) == 0.0  # one 6000 x 6000-word sentence pair > MAX_LCS_CELLS
    assert rouge_metrics.rouge_score(words[:20000], words[:20000]) == pytest.approx(1.0)
