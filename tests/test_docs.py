"""The docs' worked example runs as written: docs/adding-a-method.md's code blocks, in order, on a tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ripplekv.methods.base import SCORERS
from ripplekv.methods.presets import PRESETS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def code_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_adding_a_method_runs_as_written(tiny_model, monkeypatch):
    blocks = code_blocks(DOCS / "adding-a-method.md")
    assert len(blocks) == 3
    monkeypatch.setattr("ripplekv.methods.presets.PRESETS", dict(PRESETS))  # the example's name leaves with the test
    monkeypatch.setitem(SCORERS, "vnorm", None)  # undone after the test: the example's scorer leaves too
    import ripplekv.methods as methods
    import ripplekv.methods.presets as presets

    monkeypatch.setattr(methods, "PRESETS", presets.PRESETS)
    namespace = {"model": tiny_model}
    for block in blocks:
        exec(compile(block, "adding-a-method.md", "exec"), namespace)
    method = namespace["method"]
    state, counts = namespace["state"], namespace["counts"]
    kept = method.select(state, 32)
    assert int(kept.sum()) == int(counts.sum())
    # VNorm keeps each head's largest value norms beyond the window: checked against a plain sort.
    layer, head, window = 0, 0, 8
    norms = state.values[layer][head, : state.length - window].float().norm(dim=-1)
    top = set(norms.argsort(descending=True)[: int(counts[layer, head]) - window].tolist())
    assert set(kept[layer, head, : state.length - window].nonzero().flatten().tolist()) == top


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_link_only_to_files_that_exist(page):
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (DOCS / target).exists(), f"{page} links to {target}, which does not exist"


def test_the_kvpress_coverage_table_has_a_row_for_every_press_and_names_real_methods():
    """docs/methods.md's coverage table: one row per press class kvpress 0.5.5 exports (the committed list, since the
    reference venv is not there in CI), and every spec its ripplekv column names builds."""
    from ripplekv.methods import make_method

    listed = (DOCS.parent / "tests" / "data" / "kvpress-0.5.5-presses.txt").read_text().split()
    table = (DOCS / "methods.md").read_text().split("## kvpress 0.5.5 coverage", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*?) \|", table, flags=re.M))
    assert sorted(rows) == sorted(listed) and len(listed) == 46
    specs = [spec for ours in rows.values() for spec in re.findall(r"`([a-z][\w:=./-]*)`", ours)]
    assert len(specs) >= 14
    for spec in specs:
        if not spec.startswith(("--", "split=", "scorer=")) and "=CSV" not in spec:
            make_method(spec)
