"""An eval run directory read back as pandas DataFrames, so nobody parses `predictions.jsonl` by hand.

Budgets are nullable integers (`full` has none), as the files mean them, not floats that print as 128.0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.runs.files import CONFIG, PREDICTIONS, without_torn_sample
from ripplekv.runs.jsonl import read_jsonl

SCORES = "scores.csv"
LEADERBOARD = "leaderboard.csv"
INTEGER_COLUMNS = ("budget", "rank", "n", "new_tokens", "kept_entries", "prompt_tokens", "compressed_tokens", "tasks")


@dataclass
class Run:
    """One eval run: a line per (sample, method, budget) in `predictions`; `scores` (per task) and
    `leaderboard` (per method and budget, with intervals) are None until `ripplekv report` has written them."""

    path: Path
    config: dict
    predictions: object  # pandas.DataFrame
    scores: object | None = None
    leaderboard: object | None = None


def _integers(frame):
    """Whole-number columns as pandas' nullable Int64 (empty cells stay missing)."""
    for column in INTEGER_COLUMNS:
        if column in frame.columns:
            values = frame[column]
            numeric = values.dropna()
            if len(numeric) and all(float(v).is_integer() for v in numeric):
                frame[column] = values.astype("Int64")
    return frame


def _csv(path: Path):
    import pandas as pd

    if not path.is_file():
        return None
    try:
        return _integers(pd.read_csv(path))
    except (ValueError, pd.errors.ParserError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path} is not a readable CSV ({first}); rerun `ripplekv report {path.parent}`") from None


def load_run(path: str | Path) -> Run:
    """Read a folder written by `ripplekv eval` (or `ripplekv report`)."""
    import pandas as pd

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"run directory {folder} does not exist; pass a folder written by `ripplekv eval`")
    if not (folder / PREDICTIONS).is_file():
        raise UserError(f"{folder} has no {PREDICTIONS}; pass a folder written by `ripplekv eval`")
    lines = read_jsonl(folder / PREDICTIONS)
    rows = lines.objects
    if lines.torn.strip():  # as `report` reads it: the torn sample is left out, and named in a warning
        import warnings

        rows = without_torn_sample(folder / PREDICTIONS, rows, lines.torn,
                                   say=lambda text: warnings.warn(text, RuntimeWarning, stacklevel=4))
    config: dict = {}
    if (folder / CONFIG).is_file():
        try:
            config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
        except ValueError:
            raise UserError(f"{folder / CONFIG} is not valid JSON; use a run folder written by `ripplekv eval`") from None
        if not isinstance(config, dict):
            raise UserError(f"{folder / CONFIG} is not a JSON object; use a run folder written by `ripplekv eval`")
    predictions = _integers(pd.DataFrame(rows))
    return Run(folder, config, predictions, _csv(folder / SCORES), _csv(folder / LEADERBOARD))
