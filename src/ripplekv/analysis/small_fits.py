"""Rows read from a learned fit too small to rank, and rows read from files fitted before the run.

KVzap's surrogates and FastKVzip's gates are trained on (hidden state, KVzip score) pairs from calibration prompts;
the ones shipped for the bundled model are smoke-size (4 prompts of about 500 tokens, 3 trained on), made so the
methods run end to end. Ranking such a row beside methods that need no fit would judge the size of the fit, not the
method, so a row whose learned fit used fewer than MIN_FIT_PROMPTS calibration prompts (the fitters' default
`--calib-samples`) is flagged `small_fit`: listed, left out of ranks, verdicts and the headline, with the fit's
size named. A fit at the default size is ranked. The records of what each row's files were fitted on come from
the commands that render a report (`methods.fit_records`: analysis names no method) and are kept in report.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

COLUMN = "small_fit"
VERDICT = "small fit"
MIN_FIT_PROMPTS = 16  # the fitters' default --calib-samples, and the study's bar for a learned scorer
RECORDS = "fit_records"  # report.json's key


def _size(record: dict) -> str:
    trained, pairs = record.get("train_prompts"), record.get("train_pairs")
    inner = ", ".join(part for part in (f"{trained} trained on" if trained is not None else "",
                                        f"{pairs} pairs" if pairs is not None else "") if part)
    return f"{record['prompts']} calibration prompts" + (f" ({inner})" if inner else "")


def small_fits(records: dict[str, list[dict]]) -> dict[str, str]:
    """label -> what its fit was ("`F` fitted on 4 calibration prompts (3 trained on, 900 pairs)") for every row
    (`records`: label -> its fitted files' records) reading a learned fit of fewer than MIN_FIT_PROMPTS prompts."""
    flagged = {}
    for label, files in records.items():
        for record in files:
            if record.get("learned") and record.get("prompts", MIN_FIT_PROMPTS) < MIN_FIT_PROMPTS:
                flagged[label] = f"`{record['file_name']}` fitted on {_size(record)}"
    return flagged


def flag(board: pd.DataFrame, small: dict[str, str]) -> pd.DataFrame:
    """`board` with the `small_fit` column (True on every row of a flagged method) and its verdicts saying why
    (the tables leave unranked rows unjudged under the answer-aware word); unchanged when nothing is flagged."""
    if not small:
        return board
    methods = board["method"].astype(str)
    flagged = methods.isin(set(small))
    for verdict in ("kl_verdict", "verdict"):
        if verdict in board:
            board.loc[flagged & board[verdict].eq("answer-aware"), verdict] = VERDICT
    board[COLUMN] = flagged
    return board


def shown(view: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard for reading: a `small fit` column after `rank` when some row is flagged, else none."""
    if COLUMN not in view:
        return view
    flagged = view.pop(COLUMN).astype(bool)
    if flagged.any():
        view.insert(view.columns.get_loc("rank") + 1 if "rank" in view else 0, VERDICT,
                    flagged.map({True: "yes", False: ""}))
    return view


def note(small: dict[str, str], present) -> list[str]:
    """summary.md's lines naming the flagged methods present in a table (none: no lines)."""
    marked = [m for m in dict.fromkeys(map(str, present)) if m in small]
    if not marked:
        return []
    said = "; ".join(f"`{m}`: {small[m]}" for m in marked)
    return [f"Small fit: {said}. A learned scorer fitted on fewer than {MIN_FIT_PROMPTS} calibration prompts is "
            "smoke-size, made so the method runs: listed, left out of ranks, verdicts and the headline. A fit at the "
            f"default size (`ripplekv fit kvzap` or `ripplekv fit fastkvzip`, `--calib-samples {MIN_FIT_PROMPTS}`, "
            "then `weights=FILE`) is ranked.", ""]


def fitted_elsewhere_lines(eval_dir: Path) -> list[str]:
    """A paragraph naming the run's rows that read a file shipped for the bundled model, and what each file was
    fitted on (from its report.json; none when no row does)."""
    try:
        records = json.loads((eval_dir / "report.json").read_text(encoding="utf-8")).get(RECORDS) or {}
    except (OSError, ValueError):
        return []
    said = []
    for label, files in records.items():
        for record in files:
            if record.get("shipped"):
                tasks = f" ({', '.join(record['tasks'])})" if record.get("tasks") else ""
                took = f", {record['seconds'] / 60:.0f} min" if record.get("seconds") else ""
                said.append(f"`{label}` reads `{record['file_name']}`, fitted on {record['prompts']} calibration prompts "
                            f"of {record.get('target_tokens')} tokens{tasks}{took}")
    if not said:
        return []
    return ["", "**Fitted before this run.** These rows read a file shipped for the bundled model, fitted once on "
            "other calibration prompts than this run's, so they are in no calibration draw here: " + "; ".join(said)
            + ". `make study` fits every calibrated allocation on the same prompts in each draw."]
