"""What a run's web page shows, as plain data (`analysis.html_page` inlines it as JSON beside the page's script).

It reads the files `ripplekv report` writes (leaderboard.csv, headline.csv, scores.csv, memory_axis.csv,
report.json, config.json) and the predictions, never recomputes a statistic, and reads columns defensively: a
column the leaderboard gains later is shown as it is. The critical KV footprint is added when an older
leaderboard lacks it. The per-method panel's samples are those whose answer diverged most from the full cache's
(highest KL), with both answers; what the method kept on them needs the model (`ripplekv inspect`), so the page
gives that command rather than a picture.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

from ripplekv.analysis.footprint import COLUMNS as FOOTPRINT_COLUMNS
from ripplekv.analysis.footprint import add_footprint
from ripplekv.errors import UserError
from ripplekv.runs.files import CONFIG, PREDICTIONS, REFERENCE, is_ceiling, run_ceilings
from ripplekv.runs.jsonl import read_jsonl

WORST = 3  # samples shown per method
TEXT = 360  # characters of a prompt excerpt or an answer shown
# (column, heading, its interval's columns or None): the leaderboard's columns in the order shown, when present
SHOWN = [
    ("method", "method", None), ("budget", "B", None), ("rank", "rank", None), ("n", "n", None),
    ("kl", "KL to full", ("kl_ci_low", "kl_ci_high")),
    ("agreement", "agreement", ("agreement_ci_low", "agreement_ci_high")),
    ("kl_ratio_vs_uniform", "KL ÷ baseline", ("kl_ratio_ci_low", "kl_ratio_ci_high")),
    ("p_kl_vs_uniform_holm", "Holm p (KL)", None), ("kl_verdict", "KL verdict", None),
    ("avg_informative", "score (informative)", ("avg_informative_ci_low", "avg_informative_ci_high")),
    ("delta_vs_uniform", "score − baseline", ("delta_ci_low", "delta_ci_high")),
    ("p_vs_uniform_holm", "Holm p (score)", None), ("verdict", "score verdict", None),
    ("footprint", "critical footprint", ("footprint_low", "footprint_high")),
    ("avg", "score (all tasks)", ("avg_ci_low", "avg_ci_high")), ("versus", "baseline", None),
]
# Columns the table does not show on their own (used inside another cell, or repeated run-wide context)
HIDDEN = {"tasks", "informative_tasks", "protocol", "footprint_measure", "kl_delta_vs_uniform", "kl_delta_ci_low",
          "kl_delta_ci_high", "p_kl_vs_uniform", "p_vs_uniform", "kl_mdd", "score_mdd"}


def clean(value):
    """A JSON-safe scalar: NaN and pandas' missing values become None, numpy numbers plain numbers."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA or value is pd.NaT:
        return None
    if hasattr(value, "item"):
        return clean(value.item())
    return value


def records(frame: pd.DataFrame | None) -> list[dict]:
    if frame is None:
        return []
    return [{str(k): clean(v) for k, v in row.items()} for row in frame.to_dict("records")]


def read_csv(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_csv(path) if path.is_file() else None
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return None


def read_json(path: Path) -> dict:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def result_lines(run_dir: Path) -> pd.DataFrame:
    """The run's prediction lines with numbers (a torn last line and infeasible variants left out, as the report
    leaves them out). Read here, not through `analysis.report`, which writes this page."""
    lines = read_jsonl(run_dir / PREDICTIONS).objects
    if not lines:
        raise UserError(f"{run_dir} has no result lines in {PREDICTIONS}; run `ripplekv eval --out {run_dir}` first")
    frame = pd.DataFrame(lines)
    if "infeasible" in frame.columns:
        frame = frame[frame["infeasible"].isna()].reset_index(drop=True)
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def columns_of(board: pd.DataFrame, categories: set[str]) -> list[dict]:
    """The table's columns: the known ones present, then any other column the leaderboard has (raw)."""
    used = set(HIDDEN) | categories
    shown = []
    for key, label, interval in SHOWN:
        used.add(key)
        used.update(interval or ())
        if key in board.columns:
            shown.append({"key": key, "label": label, "interval": list(interval) if interval and
                          all(c in board.columns for c in interval) else None})
    shown += [{"key": c, "label": c, "interval": None} for c in board.columns if c not in used]
    return shown


def sample_counts(lines: pd.DataFrame) -> pd.DataFrame:
    """n per (method, budget): the samples each leaderboard row stands on."""
    counted = lines.groupby(["method", "budget"], dropna=False)["id"].nunique().rename("n").reset_index()
    counted["budget"] = counted["budget"].astype("Int64")
    return counted


def with_counts(board: pd.DataFrame, lines: pd.DataFrame) -> pd.DataFrame:
    """The board with its `n` (the leaderboard's own when it has one)."""
    if "n" in board.columns:
        return board
    keyed = board.assign(budget=board["budget"].astype("Int64"))
    merged = keyed.merge(sample_counts(lines), on=["method", "budget"], how="left")
    n = merged.pop("n")
    merged.insert(list(merged.columns).index("rank" if "rank" in merged.columns else "budget") + 1, "n", n)
    return merged


def docs_reference(name: str) -> str | None:
    """The methods table's "default follows (paper + code)" cell for a preset, when the docs are beside the
    package (a source checkout); None otherwise."""
    path = Path(__file__).resolve().parents[3] / "docs" / "methods.md"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4 and re.search(rf"`{re.escape(name)}`", cells[0]):
            return cells[3].replace("`", "")
    return None


def sample_index(config: dict, task: str, sid: str) -> int | None:
    """A sample's index within its task (for `ripplekv inspect --index`), from the run's sample list."""
    listed = (config.get("samples") or {}).get(task) if isinstance(config.get("samples"), dict) else None
    if isinstance(listed, list) and sid in listed:
        return listed.index(sid)
    return None


def inspect_command(config: dict, method: str, budget, task: str, sid: str, ceilings) -> str:
    """The command that draws what `method` kept on one sample, or why there is none."""
    if is_ceiling(method, ceilings):
        return f"{method} is answer-aware: `ripplekv inspect` does not run it (eval only)."
    index = sample_index(config, task, sid)
    parts = ["ripplekv inspect", f"--method '{method}'", f"--budget {budget}", f"--task {task}",
             f"--index {index}" if index is not None else f"--index ? (sample {sid})",
             f"--suite {config.get('suite', 'offline')}"]
    if config.get("target_tokens"):
        parts.append(f"--target-tokens {config['target_tokens']}")
    if config.get("model"):
        parts.append(f"--model {config['model']}")
    return " ".join(parts)


def cut(text, limit: int = TEXT) -> str | None:
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return None
    text = str(text)
    return text if len(text) <= limit else text[:limit] + " …"


def worst_samples(lines: pd.DataFrame, method: str, config: dict, ceilings, excerpts: dict) -> list[dict]:
    """The method's WORST lines by KL (any budget), each with the full cache's answer on the same sample."""
    own = lines[(lines["method"] == method) & lines["kl"].notna()].sort_values("kl", ascending=False, kind="stable")
    full = lines[lines["method"] == REFERENCE].drop_duplicates("id").set_index("id")
    out = []
    for row in own.head(WORST).to_dict("records"):
        reference = full.loc[row["id"]] if row["id"] in full.index else None
        asked = None if reference is None else reference.get("question")  # eval records it on the full line
        excerpt = asked if isinstance(asked, str) else excerpts.get(row["id"])
        budget = clean(row.get("budget"))
        out.append({"id": row["id"], "task": row["task"], "budget": budget, "kl": clean(row["kl"]),
                    "agreement": clean(row.get("agreement")), "score": clean(row.get("score")),
                    "prediction": cut(row.get("prediction")),
                    "full_answer": cut(None if reference is None else reference.get("prediction")),
                    "gold": cut(", ".join(map(str, row["answers"])) if isinstance(row.get("answers"), list) else None),
                    "excerpt": cut(excerpt),
                    "inspect": inspect_command(config, method, budget, row["task"], row["id"], ceilings)})
    return out


def method_panels(board: pd.DataFrame, lines: pd.DataFrame, scores: pd.DataFrame | None, config: dict,
                  ceilings, excerpts: dict, notes: dict) -> dict:
    """label -> what the per-method panel shows; `notes`: preset name -> {about, defaults, alias_of}."""
    specs = config.get("method_specs") if isinstance(config.get("method_specs"), dict) else {}
    panels = {}
    for method in dict.fromkeys(board["method"]):
        name = str(method).split(":", 1)[0]
        info = notes.get(name) or {}
        own = board[board["method"] == method]
        foot = {c: clean(own[c].iloc[0]) for c in FOOTPRINT_COLUMNS if c in own.columns and len(own)}
        tasks = scores[scores["method"] == method] if scores is not None and "method" in scores else None
        panels[method] = {
            "spec": specs.get(method), "about": info.get("about"), "defaults": info.get("defaults"),
            "alias_of": info.get("alias_of"),
            "reference": docs_reference(name), "answer_aware": bool(is_ceiling(method, ceilings)),
            "footprint": foot, "tasks": records(tasks),
            "worst": [] if method == REFERENCE else worst_samples(lines, method, config, ceilings, excerpts),
        }
    return panels


def describe(run_dir: Path, config: dict, lines: pd.DataFrame) -> dict:
    """What was measured: model, suite, tasks, lengths, n (the page says it first)."""
    tokens = lines.drop_duplicates("id")["prompt_tokens"] if "prompt_tokens" in lines else pd.Series(dtype=float)
    return {"folder": run_dir.name, "model": config.get("model_label") or config.get("model") or "the bundled model",
            "suite": config.get("suite"), "tasks": config.get("tasks") or sorted(lines["task"].unique()),
            "samples": int(lines["id"].nunique()), "limit": config.get("limit"),
            "target_tokens": config.get("target_tokens"), "protocol": config.get("protocol"),
            "prompt_tokens": [clean(tokens.min()), clean(tokens.max())] if len(tokens) else None,
            "budgets": config.get("budgets"), "device": config.get("device_name") or config.get("device"),
            "dtype": config.get("dtype"), "version": config.get("ripplekv_version")}


def run_page_data(run_dir: str | Path, excerpts: dict | None = None, notes: dict | None = None,
                  lines: pd.DataFrame | None = None) -> dict:
    """Everything the run page shows, from the report's files in `run_dir` (`ripplekv report` writes them first).
    `excerpts`: sample id -> prompt text, for runs whose lines carry none; `notes`: preset name -> {about,
    defaults, alias_of} (`methods.catalog.method_notes`; without it the panels show the resolved spec alone);
    `lines`: the prediction lines when the caller has them loaded (the report), else they are read."""
    run_dir = Path(run_dir)
    lines = result_lines(run_dir) if lines is None else lines
    board = read_csv(run_dir / "leaderboard.csv")
    if board is None:
        raise UserError(f"{run_dir} has no leaderboard.csv; run `ripplekv report {run_dir}` first")
    if "footprint" not in board.columns:
        board = add_footprint(board)
    board = with_counts(board, lines)
    config = read_json(run_dir / CONFIG)
    recorded = run_ceilings(config)
    ceilings = sorted(recorded if recorded is not None else {m for m in lines["method"].unique() if is_ceiling(m)})
    scores = read_csv(run_dir / "scores.csv")
    categories = set(scores["category"].dropna().astype(str)) if scores is not None and "category" in scores else set()
    measure = board["footprint_measure"].dropna() if "footprint_measure" in board else pd.Series(dtype=str)
    return {
        "kind": "run", "title": f"ripplekv: {run_dir.name}", "about": describe(run_dir, config, lines),
        "settings": read_json(run_dir / "report.json"), "headline": records(read_csv(run_dir / "headline.csv")),
        "columns": columns_of(board, categories), "board": records(board), "ceilings": ceilings,
        "reference": REFERENCE, "footprint_measure": measure.iloc[0] if len(measure) else None,
        "methods": method_panels(board, lines, scores, config, ceilings, excerpts or {}, notes or {}),
        "memory": records(read_csv(run_dir / "memory_axis.csv")) or None,
        "needle": records(read_csv(run_dir / "needle.csv")) or None,
    }
