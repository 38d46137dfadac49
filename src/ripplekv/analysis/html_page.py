"""Self-contained web pages of results: a run's leaderboard, two runs side by side, a needle heatmap, a site index.

Each page is one `index.html` with its data (JSON), style and script inlined: it opens from disk with no network,
and nothing is fetched at view time. The template, style and the plotting script are package data
(`analysis/html/`); the data comes from `analysis.page_data` and `analysis.page_sets`. The plots are drawn in
the browser as SVG by the page's own small plotting layer (hover names method, budget, n and value).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from ripplekv.analysis.page_data import run_page_data
from ripplekv.analysis.page_sets import (
    COMPARED,
    NEEDLE_GRID,
    PAGE,
    compare_page_data,
    compared_runs,
    needle_page_data,
    page_folders,
    site_entry,
    site_page_data,
)
from ripplekv.errors import UserError
from ripplekv.runs.files import PREDICTIONS
from ripplekv.runs.safeio import write_text

ASSETS = ("page.css", "plots.js", "tables.js", "page.js")


def asset(name: str) -> str:
    return resources.files("ripplekv.analysis").joinpath("html", name).read_text(encoding="utf-8")


def inline_json(data: dict) -> str:
    """`data` as JSON safe inside a <script> element: no `<` survives to close it early."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def page_html(data: dict) -> str:
    """The whole page: the template with the style, the data and the scripts in place."""
    from html import escape

    scripts = "\n".join(asset(name) for name in ASSETS if name.endswith(".js"))
    values = {"__TITLE__": escape(str(data.get("title") or "ripplekv results")), "/*STYLE*/": asset("page.css"),
              "__DATA__": inline_json(data), "/*SCRIPT*/": scripts.replace("</", "<\\/")}
    rest, out = asset("page.html"), []
    for marker, value in values.items():  # left to right: text put in is never searched for the next marker
        before, found, rest = rest.partition(marker)
        if not found:
            raise RuntimeError(f"the page template lacks {marker}; reinstall ripplekv")
        out += [before, value]
    return "".join(out) + rest


def write_page(folder: str | Path, data: dict) -> Path:
    path = Path(folder) / PAGE
    write_text(path, page_html(data))
    return path


def write_run_page(run_dir: str | Path, excerpts: dict | None = None, notes: dict | None = None, lines=None) -> Path:
    """`run_dir`/index.html from the report's files there (`notes`, `lines`: `page_data.run_page_data`)."""
    return write_page(run_dir, run_page_data(run_dir, excerpts, notes, lines))


def write_needle_page(folder: str | Path) -> Path:
    """The needle folder's index.html: its heatmap, linking the runs at each length."""
    return write_page(folder, needle_page_data(folder))


def write_compare_page(run_a: str | Path, run_b: str | Path, out_dir: str | Path) -> Path:
    """`out_dir`/index.html: two runs side by side with their rankings paired."""
    for run in (run_a, run_b):
        if not Path(run).is_dir():
            raise UserError(f"{run} is not a directory; --compare takes two folders written by `ripplekv eval`")
    out_dir = Path(out_dir)
    if (out_dir / PREDICTIONS).exists() or (out_dir / NEEDLE_GRID).exists():
        raise UserError(f"--out {out_dir} holds a run (its own page would be replaced); choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    page = write_page(out_dir, compare_page_data(run_a, run_b, out_dir))
    runs = [os.path.relpath(Path(run).resolve(), out_dir.resolve()) for run in (run_a, run_b)]
    write_text(out_dir / COMPARED, json.dumps({"runs": runs}, indent=2) + "\n")
    return page


def write_site(root: str | Path, pages: bool = True, notes: dict | None = None, questions=None) -> Path:
    """`root`/index.html linking a page for every eval run and needle folder under `root`; with `pages`, each of
    those pages is (re)written first from its folder's files (`notes`: what each method is; `questions`: a
    function of a run folder giving sample id -> question, for runs whose lines carry none). A folder whose
    files cannot make a page is listed with the reason, never dropped silently."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; pass a results folder (e.g. results/)")
    entries = []
    for kind, folder in page_folders(root):
        if folder == root:
            continue  # the index is root's page
        try:
            if pages:
                if kind == "run":
                    write_run_page(folder, questions(folder) if questions else None, notes)
                elif kind == "compare":
                    write_compare_page(*compared_runs(folder), folder)
                else:
                    write_needle_page(folder)
            entries.append(site_entry(root, kind, folder))
        except UserError as err:
            entries.append({"path": folder.relative_to(root).as_posix(), "kind": kind, "link": None,
                            "summary": f"no page: {err}"})
    if not entries:
        raise UserError(f"{root} holds no eval run or needle folder; run `ripplekv eval --out {root}/NAME` first")
    return write_page(root, site_page_data(root, entries))
