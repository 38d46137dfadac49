"""The task screen of a study: which model, tasks and prompt length can tell KV-cache methods apart.

A compressed cache can only be judged on a task where the full cache itself answers clearly better than a
constant answer (`analysis.informative`). The screen asks that of every candidate (model, suite, task,
prompt length) on *calibration* prompts only, so choosing the study's tasks never looks at the samples it
is then judged on. Each cell is an ordinary `eval` of the full cache alone on the calibration split
(resumable, in its own folder); the screen collects their verdicts into one table and applies a rule
fixed before any study result exists:

- per model and suite, the study length is the longest candidate length at which at least `min_tasks` tasks
  are informative (else the length with the most informative tasks, and the choice says it is short of them);
  a model's prompts are lengthened (shortest first) only while the last length had `min_tasks`: "the longest
  length that stays informative", and a small model is not run at lengths it already failed below;
- per model, its suite is the one with the most informative tasks at its length (the first listed wins a tie):
  one suite, so the study is one eval;
- the study model is the one with the most informative tasks at its study length (the first listed wins a tie);
- the study's tasks are the informative ones at that length, widest margin first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ripplekv.errors import UserError
from ripplekv.pipeline.eval_plan import RULER_CHAT_ROOM, EvalSettings
from ripplekv.runs.files import CONFIG, REFERENCE
from ripplekv.runs.safeio import write_csv, write_json

SCREEN_CSV = "screen.csv"
CHOICE_JSON = "screen.choice.json"
COLUMNS = ["model", "suite", "task", "target_tokens", "samples", "full_score", "trivial_score", "margin",
           "margin_low", "informative"]
BUDGET = 128  # eval needs a budget; the full cache alone ignores it


@dataclass(frozen=True)
class ScreenSettings:
    """The candidates: models (None: the bundled one), suites with their tasks (empty: all), prompt lengths."""

    models: tuple[str | None, ...]
    suites: tuple[tuple[str, tuple[str, ...]], ...]
    lengths: tuple[int, ...]
    limit: int = 8
    min_tasks: int = 3
    device: str = "auto"
    dtype: str = "auto"


def model_label(model: str | None) -> str:
    from ripplekv.engine.packaged import DEFAULT_MODEL

    return (model or DEFAULT_MODEL).replace("/", "--")


def cell_dir(out: Path, model: str | None, suite: str, length: int) -> Path:
    return out / model_label(model) / f"{suite}-{length}"


def cell_settings(settings: ScreenSettings, model: str | None, suite: str, tasks: tuple[str, ...],
                  length: int) -> EvalSettings:
    """The eval behind one cell: the full cache on the calibration split, room for the chat template."""
    return EvalSettings(budgets=(BUDGET,), methods=(REFERENCE,), suite=suite, tasks=tasks, limit=settings.limit,
                        split="calibration", model=model, target_tokens=length,
                        max_length=length + 2 * RULER_CHAT_ROOM, device=settings.device, dtype=settings.dtype)


def check_settings(settings: ScreenSettings) -> None:
    if not settings.models or not settings.suites or not settings.lengths:
        raise UserError("the screen needs at least one model, one suite and one length")
    if settings.limit < 2:
        raise UserError(f"--limit must be at least 2 (the informative rule needs a spread), got {settings.limit}")
    if settings.min_tasks < 1:
        raise UserError(f"--min-tasks must be at least 1, got {settings.min_tasks}")


def run_screen(settings: ScreenSettings, out: str | Path, console=None) -> pd.DataFrame:
    """Run (or resume) every cell's eval, then write `screen.csv` and `screen.choice.json` into `out`."""
    from ripplekv.pipeline.evaluate import run_eval

    check_settings(settings)
    out = Path(out)
    lengths = sorted(settings.lengths)
    cells = [(model, suite, tasks) for model in settings.models for suite, tasks in settings.suites]
    for index, (model, suite, tasks) in enumerate(cells, 1):
        for length in lengths:
            if console is not None:
                console.print(f"screen: {index}/{len(cells)}: {model_label(model)}, {suite}, {length} tokens",
                              markup=False)
            folder = cell_dir(out, model, suite, length)
            run_eval(cell_settings(settings, model, suite, tasks, length), folder, console=console)
            found = informative_count(folder)
            if found < settings.min_tasks and length != lengths[-1]:
                if console is not None:
                    console.print(f"screen: {found} informative task(s) at {length} tokens, fewer than "
                                  f"{settings.min_tasks}: longer prompts are not screened for this model and suite",
                                  markup=False)
                break
    table = collect(out)
    write_csv(out / SCREEN_CSV, table, index=False)
    write_json(out / CHOICE_JSON, choose(table, settings.min_tasks, [model_label(m) for m in settings.models]))
    return table


def informative_count(folder: Path) -> int:
    """How many tasks one finished cell found informative."""
    verdicts = pd.read_csv(folder / "informative.csv")
    return int((verdicts["informative"].astype(str) == "True").sum())


def collect(out: Path) -> pd.DataFrame:
    """One row per (model, suite, task, length) from every cell folder under `out` that has a verdict."""
    rows = []
    for config_path in sorted(out.glob(f"*/*/{CONFIG}")):
        folder = config_path.parent
        verdicts = folder / "informative.csv"
        if not verdicts.exists():
            continue
        config = json.loads(config_path.read_text(encoding="utf-8"))
        table = pd.read_csv(verdicts)
        for row in table.to_dict("records"):
            rows.append({"model": folder.parent.name, "suite": config["suite"], "task": row["task"],
                         "target_tokens": int(config["target_tokens"]), **{k: row[k] for k in COLUMNS[4:]}})
    return pd.DataFrame(rows, columns=COLUMNS)


def choose(table: pd.DataFrame, min_tasks: int, model_order: Sequence[str]) -> dict:
    """The study's model, suite, length and tasks by the rule in the module docstring (deterministic)."""
    if table.empty:
        raise UserError("the screen has no verdicts yet: run it first")
    informative = table[table["informative"].astype(str) == "True"]
    suites = list(dict.fromkeys(table["suite"]))
    per_model = {}
    for model in [m for m in model_order if m in set(table["model"])]:
        options = [_choice_in(table[(table["model"] == model) & (table["suite"] == suite)],
                              informative[(informative["model"] == model) & (informative["suite"] == suite)],
                              suite, min_tasks)
                   for suite in suites if ((table["model"] == model) & (table["suite"] == suite)).any()]
        per_model[model] = max(options, key=lambda o: (len(o["tasks"]), -options.index(o)))
    best = max(per_model, key=lambda m: (len(per_model[m]["tasks"]), -list(per_model).index(m)))
    return {"rule": f"per model and suite, the longest length with >= {min_tasks} informative tasks; the suite "
                    "with the most; the model with the most; tasks by margin", "min_tasks": min_tasks,
            "model": best, **per_model[best], "per_model": per_model}


def _choice_in(table: pd.DataFrame, informative: pd.DataFrame, suite: str, min_tasks: int) -> dict:
    """One model's length and tasks within one suite."""
    counts = informative.groupby("target_tokens")["task"].nunique()
    lengths = sorted(table["target_tokens"].unique())
    enough = [length for length in lengths if counts.get(length, 0) >= min_tasks]
    length = (max(enough) if enough
              else max(lengths, key=lambda n: (counts.get(n, 0), -n)))  # the most tasks, the shortest of ties
    chosen = informative[informative["target_tokens"] == length]
    chosen = chosen.sort_values(["margin_low", "task"], ascending=[False, True])
    return {"suite": suite, "target_tokens": int(length), "tasks": [f"{suite}:{t}" for t in chosen["task"]],
            "enough_tasks": bool(enough)}
