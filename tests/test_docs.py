"""The docs' worked example runs as written: docs/adding-a-method.md's code blocks, in order, on a tiny model, and
its two source changes (one new module, one table line), written into a copy of the package, are all a new signal
and its scorer take: the method runs there, and the structure and method-registry tests pass there."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.recorders import RECORDERS, WINDOW_QUERIES
from ripplekv.methods.core.base import SCORERS
from ripplekv.methods.core.presets import PRESETS, read_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
WALKTHROUGH = DOCS / "adding-a-method.md"


def code_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def source_changes(path: Path = WALKTHROUGH) -> list[tuple[str, str]]:
    """(file under the repository, its block) for every section whose heading names a source file: the first
    code block of a section titled with a module is the whole module, of one titled "one line in" a line added."""
    changes = []
    for heading, body in re.findall(r"^## (.*?)\n(.*?)(?=^## |\Z)", path.read_text(), flags=re.S | re.M):
        named = re.search(r"`(src/ripplekv/[\w/]+\.(?:py|toml))`", heading)
        if named:
            changes.append((named.group(1), re.findall(r"```\w+\n(.*?)```", body, flags=re.S)[0]))
    return changes


def test_adding_a_method_runs_as_written(tiny_model, monkeypatch):
    blocks = code_blocks(WALKTHROUGH)
    assert len(blocks) == 2
    (_, line), = [change for change in source_changes() if change[0].endswith(".toml")]
    module = types.ModuleType("ripplekv.methods.querygram")  # the new file, as the package would import it
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SCORERS, "querygram", None)  # undone after the test: the example's scorer and recorder leave too
    monkeypatch.setitem(RECORDERS, "query_gram", None)
    exec(compile(blocks[0], "adding-a-method.md", "exec"), module.__dict__)
    for name, preset in read_table(line).items():  # the table line, as the table reads it; it leaves with the test
        monkeypatch.setitem(PRESETS, name, preset)
    namespace = {"model": tiny_model}
    exec(compile(blocks[1], "adding-a-method.md", "exec"), namespace)
    method, state, counts = namespace["method"], namespace["state"], namespace["counts"]
    kept = method.select(state, 32)
    assert int(kept.sum()) == int(counts.sum())
    # The recorded Gram matrices against the queries themselves, captured whole through the window's recorder.
    whole = prefill_for(tiny_model, state.input_ids, Requirements(capture_window=state.length))
    for layer in range(state.num_layers):
        queries = whole.signal(WINDOW_QUERIES)[layer].double()  # [H_q, n, d]: every prompt query
        gram = queries.transpose(-1, -2) @ queries / state.length
        assert torch.allclose(state.signal("query_gram")[layer].double(), gram, rtol=1e-4, atol=1e-6)
    # QueryGram keeps each head's largest k^T G k beyond the window: checked against a plain sort, head by head.
    layer, window = 0, 8
    gram = state.signal("query_gram")[layer].double()
    group = gram.shape[0] // state.num_kv_heads
    for head in range(state.num_kv_heads):
        keys = state.keys[layer][head, : state.length - window].double()
        scores = sum(((keys @ gram[head * group + g]) * keys).sum(-1) for g in range(group))
        top = set(scores.argsort(descending=True)[: int(counts[layer, head]) - window].tolist())
        assert set(kept[layer, head, : state.length - window].nonzero().flatten().tolist()) == top


def changed_files(before: Path, after: Path) -> set[str]:
    """Files (relative paths) that differ between two trees, or exist in one only; caches left out."""
    found = set()

    def walk(compared: filecmp.dircmp, prefix: str) -> None:
        for name in compared.left_only + compared.right_only + compared.diff_files + compared.funny_files:
            if name != "__pycache__":
                found.add(prefix + name)
        for name, sub in compared.subdirs.items():
            if name != "__pycache__":
                walk(sub, prefix + name + "/")

    walk(filecmp.dircmp(before, after, ignore=["__pycache__"]), "")
    return found


def test_a_new_signal_and_its_scorer_touch_one_module_and_one_table_line(tiny_model_dir, tmp_path):
    """The page's two changes, written into a copy of the package, are all eval needs to run the new method with
    its new signal: no other file changes, the budget is exact, and the structure and method-registry tests pass
    on the copy (the 400-line rule, the import rules, every preset's family and registration)."""
    changes = source_changes()
    assert [path for path, _ in changes] == ["src/ripplekv/methods/querygram.py", "src/ripplekv/methods/presets.toml"]
    copy = tmp_path / "src" / "ripplekv"
    shutil.copytree(ROOT / "src" / "ripplekv", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("tests", "docs"):  # the tests, and the design page test_structure reads
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (new_file, module), (table, line) = changes
    (tmp_path / new_file).write_text(module)
    assert len(line.strip().splitlines()) == 1
    with (tmp_path / table).open("a") as fh:
        fh.write(line)
    assert changed_files(ROOT / "src" / "ripplekv", copy) == {"methods/querygram.py", "methods/presets.toml"}
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # eval's own per-sample function (`ripplekv.generate`), in a fresh interpreter that imports the copy
    script = (f"import json, ripplekv; model, tokenizer = ripplekv.load_model({str(tiny_model_dir)!r}); "
              "answers = ripplekv.generate(model, tokenizer, 'The cat sat on the mat. ' * 30, 'Where did it sit?', "
              "methods=['querygram'], budgets=[32], max_new_tokens=4); "
              "print(json.dumps([ripplekv.__file__] + [(a.method, a.kept_entries) for a in answers]))")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    where, *answers = json.loads(done.stdout.splitlines()[-1])
    assert Path(where).is_relative_to(copy)  # the copy ran, not the checkout
    full = dict(answers)["full"]
    assert full > 32 * 4 * 2 and dict(answers)["querygram"] == 4 * 2 * 32  # L x H_kv x B, exactly
    # the copy's structure and method-registry tests, on the copy's package (their SRC is the copy's)
    on_copy = {**env, "PYTHONPATH": f"{tmp_path / 'src'}{os.pathsep}{tmp_path}"}
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/test_structure.py", "tests/test_methods.py", "-q", "-x"],
                           env=on_copy, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", tests.stdout) and "querygram" in (copy / "methods" / "presets.toml").read_text()


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
