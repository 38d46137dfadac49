"""Rows read from a learned fit too small to rank.

KVzap's surrogates and FastKVzip's gates are trained on (hidden state, KVzip score) pairs from calibration prompts;
each weights file's sidecar records how many prompts it was fitted on (`train_prompts` and `held_out_prompts`). The
ones shipped for the bundled model are smoke-size (4 prompts of about 500 tokens, 3 trained on), made so the methods
run end to end. Ranking such a row beside methods that need no fit would judge the size of the fit, not the method,
so a row whose fit used fewer than MIN_FIT_PROMPTS calibration prompts (the fitters' default `--calib-samples`) is
flagged `small_fit`: listed, left out of ranks, verdicts and the headline, with the fit's size named. A fit at the
default size (`ripplekv fit kvzap`, then `kvzap:weights=FILE`) is ranked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from ripplekv.analysis.shipped_fits import LEARNED, shipped_scorer_file

COLUMN = "small_fit"
VERDICT = "small fit"
MIN_FIT_PROMPTS = 16  # the fitters' default --calib-samples, and the study's bar for a learned scorer


def _learned_parts(spec) -> Iterator[dict]:
    """Every dict in a resolved spec that names a learned scorer (a composite nests its parts)."""
    if isinstance(spec, dict):
        if spec.get("name") in LEARNED:
            yield spec
        for value in spec.values():
            yield from _learned_parts(value)
    elif isinstance(spec, list):
        for value in spec:
            yield from _learned_parts(value)


def fit_size(part: dict, bundled: bool) -> dict | None:
    """{"prompts", "train_prompts", "train_pairs"} of the file `part` reads (given, else shipped for the bundled
    model); None when its sidecar is not at hand or does not say."""
    path = Path(part["weights"]) if part.get("weights") else (shipped_scorer_file(part) if bundled else None)
    side = path.with_suffix(".json") if path is not None else None
    try:
        info = json.loads(side.read_text(encoding="utf-8")) if side is not None else {}
    except (OSError, ValueError):
        return None
    if "train_prompts" not in info:
        return None
    trained = int(info["train_prompts"])
    return {"prompts": trained + int(info.get("held_out_prompts") or 0), "train_prompts": trained,
            "train_pairs": info.get("train_pairs")}


def bundled_run(run_dir: str | Path) -> bool:
    """Whether a run's config.json names the bundled model (whose shipped fits a method reads when given none)."""
    from ripplekv.engine.packaged import DEFAULT_MODEL
    from ripplekv.runs.files import CONFIG

    try:
        model = json.loads((Path(run_dir) / CONFIG).read_text(encoding="utf-8")).get("model")
    except (OSError, ValueError):
        return False
    return model in (None, "", DEFAULT_MODEL)


def small_fits(specs: dict, bundled: bool) -> dict[str, str]:
    """label -> what its fit was ("kvzap fitted on 4 calibration prompts (3 trained on, 900 pairs)") for every
    method of the run (`specs`: label -> resolved spec, config.json's) reading a learned fit of fewer than
    MIN_FIT_PROMPTS calibration prompts."""
    flagged = {}
    for label, spec in specs.items():
        for part in _learned_parts(spec):
            size = fit_size(part, bundled)
            if size is not None and size["prompts"] < MIN_FIT_PROMPTS:
                pairs = f", {size['train_pairs']} pairs" if size["train_pairs"] is not None else ""
                flagged[label] = (f"{part['name']} fitted on {size['prompts']} calibration prompts "
                                  f"({size['train_prompts']} trained on{pairs})")
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
