"""The data of the pages that gather runs: two runs side by side (`ripplekv report --compare`), a needle folder's
heatmap, and the site index that links every page under a results folder.

A compare page pairs the rankings: at each budget both runs have, the methods run in both, ranked by KL to their
own full cache (the leaderboard's `rank` when it has one: answer-aware variants are left out of it), with the rank
in each run and the change. Runs of different models are compared by rank, never by KL values, whose scale is the
model's own.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ripplekv.analysis.page_data import clean, read_csv, read_json, records, run_page_data
from ripplekv.errors import UserError
from ripplekv.runs.files import CONFIG, PREDICTIONS, REFERENCE

PAGE = "index.html"
NEEDLE_GRID = "needle.csv"
COMPARED = "compare.json"  # beside a compare page: the two runs it pairs (relative paths), so --site redraws it


def ranked(board: pd.DataFrame) -> pd.DataFrame:
    """method, budget, rank, kl: the leaderboard's ranks (by KL within a budget when it has none)."""
    rows = board[(board["method"] != REFERENCE) & board["budget"].notna()].copy()
    if "rank" not in rows or rows["rank"].isna().all():
        rows["rank"] = rows.groupby("budget")["kl"].rank(method="min")
    rows = rows[rows["rank"].notna()]
    return rows[["method", "budget", "rank", "kl"]].assign(budget=rows["budget"].astype(int),
                                                           rank=rows["rank"].astype(int))


def paired_ranks(board_a: pd.DataFrame, board_b: pd.DataFrame) -> pd.DataFrame:
    """Per budget in both runs, each method ranked in both: its rank in each (re-ranked among the shared methods,
    so the two columns are on one scale) and the change (B's rank minus A's: negative moved up)."""
    both = ranked(board_a).merge(ranked(board_b), on=["method", "budget"], suffixes=("_a", "_b"))
    if both.empty:
        return pd.DataFrame(columns=["budget", "method", "rank_a", "rank_b", "change", "kl_a", "kl_b",
                                     "rank_a_run", "rank_b_run"])
    both = both.rename(columns={"rank_a": "rank_a_run", "rank_b": "rank_b_run"})
    both["rank_a"] = both.groupby("budget")["rank_a_run"].rank(method="min").astype(int)
    both["rank_b"] = both.groupby("budget")["rank_b_run"].rank(method="min").astype(int)
    both["change"] = both["rank_b"] - both["rank_a"]
    both = both.sort_values(["budget", "rank_a", "method"]).reset_index(drop=True)
    return both[["budget", "method", "rank_a", "rank_b", "change", "kl_a", "kl_b", "rank_a_run", "rank_b_run"]]


def rank_agreement(pairs: pd.DataFrame) -> list[dict]:
    """Per budget: methods paired and Spearman's rank correlation between the two runs (None under 3 methods)."""
    out = []
    for budget, rows in pairs.groupby("budget"):
        rho = rows["rank_a"].corr(rows["rank_b"], method="spearman") if len(rows) >= 3 else None
        out.append({"budget": int(budget), "methods": len(rows), "spearman": clean(rho)})
    return out


def compare_page_data(run_a: str | Path, run_b: str | Path, out_dir: str | Path) -> dict:
    """Both runs' pages' data (leaderboards, headlines, what was measured) and their paired rankings; links to
    each run's own page are relative to `out_dir`."""
    import os

    sides = []
    for run in (run_a, run_b):
        data = run_page_data(run)
        data.pop("methods")  # the per-method panels stay on each run's own page
        page = Path(run) / PAGE
        data["link"] = os.path.relpath(page, Path(out_dir)) if page.is_file() else None
        data["about"]["path"] = os.path.relpath(Path(run), Path(out_dir))
        sides.append(data)
    boards = [pd.DataFrame(side["board"]) for side in sides]
    pairs = paired_ranks(*boards)
    names = [Path(run).resolve().name for run in (run_a, run_b)]
    if len(set(names)) < 2:  # one folder name for both: their paths from the folder holding both tell them apart
        both = [Path(run).resolve() for run in (run_a, run_b)]
        names = [Path(os.path.relpath(run, os.path.commonpath(both))).as_posix() for run in both]
    return {"kind": "compare", "title": f"ripplekv: {names[0]} vs {names[1]}", "runs": sides, "names": names,
            "pairs": records(pairs), "agreement": rank_agreement(pairs), "reference": REFERENCE}


def needle_page_data(folder: str | Path) -> dict:
    """The needle heatmap (needle.csv of `ripplekv needle`) and links to the runs at each length."""
    folder = Path(folder)
    grid = read_csv(folder / NEEDLE_GRID)
    if grid is None:
        raise UserError(f"{folder} has no readable {NEEDLE_GRID}; run `ripplekv needle --out {folder}` first")
    runs = sorted((p for p in folder.iterdir() if (p / PREDICTIONS).is_file()), key=lambda p: (len(p.name), p.name))
    config = read_json(runs[0] / CONFIG) if runs else {}
    return {"kind": "needle", "title": f"ripplekv: needle ({folder.name})", "needle": records(grid),
            "about": {"folder": folder.name, "model": config.get("model_label") or config.get("model"),
                      "tasks": config.get("tasks"), "suite": config.get("suite")},
            "runs": [{"name": p.name, "link": f"{p.name}/{PAGE}"} for p in runs], "reference": REFERENCE}


def page_folders(root: Path) -> list[tuple[str, Path]]:
    """(kind, folder) for every folder under `root` a page is written for: eval runs, needle folders and compare
    pages, in path order; hidden folders are skipped."""
    found = []
    for path in sorted([root, *root.rglob("*")]):
        if not path.is_dir() or any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        if (path / PREDICTIONS).is_file():
            found.append(("run", path))
        elif (path / NEEDLE_GRID).is_file():
            found.append(("needle", path))
        elif (path / COMPARED).is_file():
            found.append(("compare", path))
    return found


def site_entry(root: Path, kind: str, folder: Path) -> dict:
    """One row of the site index: where the page is and what it measured, with its headline at each budget."""
    entry = {"path": folder.relative_to(root).as_posix() or ".", "kind": kind,
             "link": (folder / PAGE).relative_to(root).as_posix()}
    if kind == "needle":
        return {**entry, "model": None, "samples": None, "summary": "needle depth x length heatmap"}
    if kind == "compare":
        runs = compared_runs(folder)
        return {**entry, "model": None, "samples": None,
                "summary": "rankings paired: " + " vs ".join(p.relative_to(root.resolve()).as_posix()
                                                            if p.is_relative_to(root.resolve()) else str(p) for p in runs)}
    config = read_json(folder / CONFIG)
    headline = read_csv(folder / "headline.csv")
    closest = []
    # a run of the full cache alone (the study's screen) has a headline with no rows
    if headline is not None and not headline.empty and {"budget", "closest"} <= set(headline.columns):
        first = headline[headline["scope"] == headline["scope"].iloc[0]] if "scope" in headline else headline
        closest = [f"B={int(b)}: {m}" for b, m in zip(first["budget"], first["closest"]) if pd.notna(b)]
    samples = config.get("samples")
    count = sum(len(v) for v in samples.values() if isinstance(v, list)) if isinstance(samples, dict) else None
    return {**entry, "model": config.get("model_label") or config.get("model"), "suite": config.get("suite"),
            "samples": count, "summary": "closest to the full cache: " + "; ".join(closest) if closest else ""}


def compared_runs(folder: Path) -> list[Path]:
    """The two run folders a compare page pairs, from its compare.json."""
    recorded = read_json(folder / COMPARED).get("runs")
    if not isinstance(recorded, list) or len(recorded) != 2:
        raise UserError(f"{folder / COMPARED} does not name two runs; write it again with `ripplekv report --compare`")
    return [(folder / str(path)).resolve() for path in recorded]


def site_page_data(root: str | Path, entries: list[dict]) -> dict:
    return {"kind": "site", "title": f"ripplekv results: {Path(root).resolve().name}", "pages": entries}
