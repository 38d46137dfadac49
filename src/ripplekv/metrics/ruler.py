"""RULER's scorers, from its package (`long_context_eval/eval/synthetic/constants.py`), on RULER's cleaned prediction.

`string_match_all` (share of the gold strings found in the prediction, case-insensitive: needles, variable
tracking, word extraction) and `string_match_part` (any gold string found: QA) are the package's own
per-sample functions. The prediction is first cleaned as RULER's `eval/evaluate.py` does (`postprocess_pred`:
strip, every control character to a newline, strip again); that three-line step is written here because
importing `evaluate.py` parses arguments and downloads nltk data at import.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ripplekv.errors import UserError

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(prediction: str) -> str:
    """RULER's `postprocess_pred`."""
    return _CONTROL.sub("\n", (prediction or "").strip()).strip()


def _package_scorer(name: str):
    try:
        from long_context_eval.eval.synthetic import constants
    except ImportError:
        raise UserError("RULER scoring needs `nvidia-long-context-eval`; run `make install` "
                        "(or `pip install --no-deps nvidia-long-context-eval==26.3`)") from None
    return getattr(constants, f"{name}_per_sample")


def _score(name: str, prediction: str, answers: Sequence[str]) -> float:
    golds = [answers] if isinstance(answers, str) else [str(a) for a in answers]
    if not golds:
        return 0.0
    return _package_scorer(name)([clean_prediction(prediction)], [golds])[0] / 100


def string_match_all_score(prediction: str, answers: Sequence[str], **kwargs) -> float:
    """RULER's string_match_all in [0, 1]: the share of gold strings the prediction contains."""
    return _score("string_match_all", prediction, answers)


def string_match_part_score(prediction: str, answers: Sequence[str], **kwargs) -> float:
    """RULER's string_match_part in [0, 1]: 1 when the prediction contains any gold string."""
    return _score("string_match_part", prediction, answers)
