"""Answer text normalisation and Chinese word segmentation, as the official LongBench scorer does them.

SQuAD-style English normalisation, the Chinese variant, and jieba's precise-mode cut (loaded lazily,
short texts cached). They sit apart because both the answer metrics (`metrics.answers`) and ROUGE-L
(`metrics.rouge`) build on them.
"""

from __future__ import annotations

import re
import string
from functools import lru_cache

# --------------------------------------------------------------------------- text normalisation

_EN_PUNCT = set(string.punctuation)
_ZH_PUNCT = _EN_PUNCT | set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lower case, drop English and Chinese punctuation and all whitespace."""
    return "".join(ch for ch in text.lower() if ch not in _ZH_PUNCT and not ch.isspace())


def _jieba_cut(text: str) -> list[str]:
    """Chinese word segmentation as the official scorer does it (precise mode); jieba is loaded lazily
    because its dictionary takes a second to build and only Chinese datasets need it. Short texts are
    cached: a prediction is cut once, not once per gold answer."""
    return list(_cut_short(text)) if len(text) <= 2000 else _cut(text)


@lru_cache(maxsize=1024)
def _cut_short(text: str) -> tuple[str, ...]:
    return tuple(_cut(text))


def _cut(text: str) -> list[str]:
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))
