"""The layout's rules: no method named in engine, pipeline or analysis code; what methods declare they need."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ripplekv.engine.prefill import Requirements
from ripplekv.methods import ALLOCATORS, PRESETS, SCORERS, make_method
from ripplekv.methods.signals.column_sums import COLUMN_SUMS

SRC = Path(__file__).resolve().parent.parent / "src" / "ripplekv"
# The project's own name, where it means the project (not the ripplekv method).
PROJECT_NAME_USES = {("engine/cache.py", "ATTENTION_NAME ="), ("engine/models.py", '".cache"')}


def named_methods(package: str) -> list[str]:
    """`file:line: name` for every string literal in `package` that is exactly a preset, scorer or allocator name."""
    names = set(PRESETS) | set(SCORERS) | set(ALLOCATORS)
    found = []
    for path in sorted((SRC / package).rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                line = lines[node.lineno - 1]
                if any(relative == where and marker in line for where, marker in PROJECT_NAME_USES):
                    continue
                found.append(f"{relative}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("package", ["engine", "pipeline", "analysis"])
def test_no_method_is_named_in_engine_pipeline_or_analysis(package):
    """Methods declare what they need (requirements, prompt_dependent, routable); code outside methods/
    never asks for one by name. The commands' default choices live in ripplekv.defaults."""
    assert named_methods(package) == []


def named_signals(package: str) -> list[str]:
    """`file:line: name` for every string literal in `package` that is a method's signal (a registered recorder's
    name other than the window queries every prefill records)."""
    from ripplekv.engine.recorders import RECORDERS, WINDOW_QUERIES

    signals = set(RECORDERS) - {WINDOW_QUERIES}
    found = []
    for path in sorted((SRC / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in signals:
                found.append(f"{path.relative_to(SRC).as_posix()}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("package", ["engine", "pipeline", "analysis"])
def test_no_signal_of_a_method_is_named_outside_methods(package):
    """A signal is its recorder and the methods that read it, all in methods/: the engine records whatever the
    requirements name, by the registry."""
    assert named_signals(package) == []


def test_the_name_check_can_fail(tmp_path, monkeypatch):
    bad = tmp_path / "pipeline"
    bad.mkdir()
    (bad / "x.py").write_text('def f(m):\n    return m.scorer.name == "router" or "ripplekv" in m.label\n')
    monkeypatch.setattr("tests.test_structure.SRC", tmp_path)
    assert named_methods("pipeline") == ["pipeline/x.py:2: 'router'", "pipeline/x.py:2: 'ripplekv'"]


def test_requirements_follow_the_methods(tmp_path):
    route = tmp_path / "route.csv"
    route.write_text("layer,method\n0,snapkv:window=96\n1,h2o\n")
    cases = {
        "full": Requirements(),
        "snapkv": Requirements(capture_window=32),
        "snapkv:window=128": Requirements(capture_window=128),
        "tova": Requirements(capture_window=1),
        "h2o": Requirements(signals={COLUMN_SUMS}),
        "knorm": Requirements(),
        "streamingllm": Requirements(),
        "cake:window=48": Requirements(capture_window=48),  # its allocator's window; its SnapKV scorer's is 32
        "gracekv:window=80": Requirements(capture_window=80),
        f"routed:route={route}": Requirements(capture_window=96, signals={COLUMN_SUMS}),
    }
    for spec, expected in cases.items():
        assert make_method(spec).requirements() == expected, spec
    union = Requirements.of_all(make_method(spec) for spec in ("snapkv:window=128", "h2o", "tova"))
    assert union == Requirements(capture_window=128, signals={COLUMN_SUMS})


def test_a_spec_window_beyond_the_window_option_is_the_one_captured():
    """`eval --window 16 --methods snapkv:window=128,snapkv:kernel=5`: the spec's own window wins for its method,
    the option sets the other's, and the prefill captures the larger one."""
    from ripplekv.engine.prefill import captured_window
    from ripplekv.methods.core.catalog import build_methods

    methods = build_methods(["snapkv:window=128", "snapkv:kernel=5"], {"window": 16})
    assert [m.requirements().capture_window for m in methods.values()] == [0, 128, 16]  # full, then the specs
    assert captured_window(Requirements.of_all(methods.values())) == 128


def test_every_task_of_every_suite_resolves_to_one_metric_and_one_generation_length():
    """The registry is the one task -> metric table: a name shared by two suites (offline hotpotqa and
    LongBench's) must score and generate alike, since a prediction file names only the dataset."""
    from ripplekv.metrics.scoring import METRICS, metric_for
    from ripplekv.tasks.registry import all_tasks, list_suites, task_named

    by_name: dict[str, set] = {}
    for task in all_tasks():
        assert task.metric in METRICS, task.name
        assert isinstance(task.max_new_tokens, int) and task.max_new_tokens > 0, task.name
        assert (task.builder is not None) == (task.suite == "offline"), task.name
        by_name.setdefault(task.name, set()).add((task.metric, task.max_new_tokens, task.first_line))
    assert {task.suite for task in all_tasks()} == set(list_suites())
    shared = {name: rules for name, rules in by_name.items() if len(rules) > 1}
    assert shared == {}
    for name, ((metric, max_new, _),) in by_name.items():
        assert metric_for(name) == metric and task_named(name).max_new_tokens == max_new


# --------------------------------------------------------------------------- size and voice

MOST_LINES = 400


def long_modules(src: Path) -> list[str]:
    return [f"{path.relative_to(src).as_posix()}: {count} lines" for path in sorted(src.rglob("*.py"))
            if (count := len(path.read_text(encoding="utf-8").splitlines())) > MOST_LINES]


def test_no_module_is_over_400_lines():
    """One concept per module (DESIGN.md): a module past 400 lines holds two, and is split."""
    assert long_modules(SRC) == []


def test_the_length_check_can_fail(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MOST_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MOST_LINES)
    assert long_modules(tmp_path) == [f"pkg/long.py: {MOST_LINES + 1} lines"]


def engine_voices(src: Path) -> list[str]:
    """`file:line: what` for every print, write to stderr or command-line flag (`--name`) in the engine's code
    (docstrings and quoted commands such as `pip install --no-deps x` aside): the engine raises or warns, and
    cli/ phrases what the user reads."""
    found = []
    for path in sorted((src / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        where = path.relative_to(src).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                found.append(f"{where}:{node.lineno}: print")
            elif isinstance(node, ast.Attribute) and node.attr == "stderr":
                found.append(f"{where}:{node.lineno}: stderr")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named = re.search(r"(?<![\w-])--[a-z][a-z-]+", re.sub(r"`[^`]*`", "", node.value))
                if named:
                    found.append(f"{where}:{node.lineno}: {named.group()}")
    return found


def test_the_engine_names_no_flag_and_prints_nothing():
    assert engine_voices(SRC) == []


def test_the_voice_check_can_fail(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text('"""Under `--decode-budget total` (a docstring may say so)."""\nimport sys\n'
                                              'def f(n):\n    print(f"pass --max-length {n}", file=sys.stderr)\n')
    assert sorted(engine_voices(tmp_path)) == ["engine/x.py:4: --max-length", "engine/x.py:4: print", "engine/x.py:4: stderr"]


# --------------------------------------------------------------------------- the import rule

# What each package may import (besides itself, errors and the torch-free defaults): cli -> pipeline ->
# libraries; methods -> engine; nothing imports pipeline or cli. The lm-eval backend is a front end beside the
# Python API (over the engine), which `ripplekv lm-eval` registers.
LIBRARIES = {"engine", "methods", "tasks", "metrics", "runs", "analysis"}
MAY_IMPORT = {
    "cli": {"pipeline", *LIBRARIES, "ripplekv", "lm_eval_backend"},
    "pipeline": {*LIBRARIES, "ripplekv"},
    "analysis": {"metrics", "runs", "engine"},
    "methods": {"engine", "ripplekv"},
    "metrics": {"tasks"},
    "tasks": {"engine"},
    "runs": set(),
    "engine": set(),
}
EVERYWHERE = {"errors", "defaults"}


def module_imports(src: Path) -> dict[str, set[str]]:
    """Module -> the ripplekv modules it imports (anywhere in the file, lazy imports included)."""
    files = {path: ".".join(path.relative_to(src.parent).with_suffix("").parts).removesuffix(".__init__")
             for path in src.rglob("*.py")}
    names = set(files.values())
    graph: dict[str, set[str]] = {}
    for path, module in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            for target in targets:
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    found.add(target)
        graph[module] = found
    return graph


def rule_violations(src: Path) -> list[str]:
    graph = module_imports(src)

    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    bad = []
    for module, targets in sorted(graph.items()):
        own = package(module)
        if own not in MAY_IMPORT:
            continue
        for target in sorted(targets):
            other = package(target)
            if other != own and other not in EVERYWHERE and other not in MAY_IMPORT[own]:
                bad.append(f"{module} imports {target}")
    return bad


def circles(src: Path) -> list[list[str]]:
    """Import circles among modules (a module importing its own package's __init__ does not count)."""
    graph = module_imports(src)
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    found, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


# Inside methods/: the shared parts sit below the methods and import no method module, so a method comes and goes
# without touching them (what each may import within methods/, besides itself).
METHODS_INSIDE = {"methods.core": {"methods.signals"}, "methods.signals": set()}


def inside_methods_violations(src: Path) -> list[str]:
    bad = []
    for module, targets in sorted(module_imports(src).items()):
        part = ".".join(module.split(".")[1:3])
        if part not in METHODS_INSIDE:
            continue
        for target in sorted(targets):
            other = ".".join(target.split(".")[1:3])
            if target.split(".")[1:2] == ["methods"] and other != part and other not in METHODS_INSIDE[part]:
                bad.append(f"{module} imports {target}")
    return bad


def test_the_import_rule_holds():
    assert rule_violations(SRC) == []
    assert inside_methods_violations(SRC) == []


def test_no_import_circles():
    assert circles(SRC) == []


def test_the_import_checks_can_fail(tmp_path):
    src = tmp_path / "ripplekv"
    for package in ("engine", "methods", "pipeline"):
        (src / package).mkdir(parents=True)
        (src / package / "__init__.py").write_text("")
    (src / "__init__.py").write_text("")
    (src / "engine" / "a.py").write_text("from ripplekv.methods import b\n")
    (src / "methods" / "b.py").write_text("def f():\n    from ripplekv.engine.a import x\n    import ripplekv.pipeline.c\n")
    (src / "pipeline" / "c.py").write_text("")
    assert set(rule_violations(src)) == {"ripplekv.engine.a imports ripplekv.methods",
                                         "ripplekv.engine.a imports ripplekv.methods.b",
                                         "ripplekv.methods.b imports ripplekv.pipeline.c"}
    assert ["ripplekv.engine.a", "ripplekv.methods.b", "ripplekv.engine.a"] in circles(src)
    for part in ("core", "signals"):
        (src / "methods" / part).mkdir()
    (src / "methods" / "core" / "c.py").write_text("from ripplekv.methods import b\nfrom ripplekv.methods.signals import s\n")
    (src / "methods" / "signals" / "s.py").write_text("from ripplekv.methods.core.c import x\n")
    assert inside_methods_violations(src) == ["ripplekv.methods.core.c imports ripplekv.methods",
                                              "ripplekv.methods.core.c imports ripplekv.methods.b",
                                              "ripplekv.methods.signals.s imports ripplekv.methods.core.c"]


# --------------------------------------------------------------------------- the design page

DESIGN = SRC.parents[1] / "docs" / "design.md"


def documented_rules(text: str, heading: str) -> dict[str, set[str]]:
    """The table under `heading` as {layer: what it may import} (the backticked names of each row; "nothing": none)."""
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \| (.*?) \|$", section, flags=re.M)
    return {layer: set(re.findall(r"`([\w.]+)`", allowed)) for layer, allowed in rows}


def test_the_design_page_states_the_rules_this_test_enforces():
    """docs/design.md's tables are the rules checked here: a rule changed in one place and not the other fails."""
    text = DESIGN.read_text(encoding="utf-8")
    assert documented_rules(text, "## What each layer may import") == MAY_IMPORT
    assert documented_rules(text, "## Inside methods/") == METHODS_INSIDE
    besides = re.search(r"^Besides itself, (.*?)\.", text, flags=re.M).group(1)  # what every layer may import
    assert set(re.findall(r"`(\w+)`", besides)) == EVERYWHERE
    assert all(f"- `{layer}/`" in text for layer in MAY_IMPORT)  # each layer is described


def test_the_design_check_can_fail():
    page = "# A page\n\n## Rules\n\n| layer | may import |\n|---|---|\n| `metrics` | `tasks`, `engine` |\n| `runs` | nothing |\n"
    assert documented_rules(page, "## Rules") == {"metrics": {"tasks", "engine"}, "runs": set()}
    assert documented_rules(page, "## Rules") != {k: v for k, v in MAY_IMPORT.items() if k in ("metrics", "runs")}


def test_eval_captures_the_window_its_methods_declare(run_cli, tiny_model_dir, tmp_path):
    """A spec's window beyond the default capture (64) runs: the prefill follows what the methods declare."""
    import json

    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah",
                           "--limit", "1", "--target-tokens", "400", "--methods", "snapkv:window=128",
                           "--budget", "160", "--out", str(out))
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["capture_window"] == 128
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["method"] == "snapkv:window=128"]
    assert row["prompt_tokens"] > 160 and row["kept_entries"] == 4 * 2 * 160


def test_markdown_tables_are_a_core_dependency_not_an_extra():
    """pandas' to_markdown needs tabulate: a plain `pip install ripplekv` must be able to write every summary."""
    import tomllib

    project = tomllib.loads((SRC.parent.parent / "pyproject.toml").read_text())["project"]
    users = [path for path in SRC.rglob("*.py") if ".to_markdown(" in path.read_text()]
    assert users, "no module writes a Markdown table any more: drop tabulate from the dependencies"
    assert any(dep.startswith("tabulate") for dep in project["dependencies"])
    assert not any(dep.startswith("tabulate") for extra in project["optional-dependencies"].values() for dep in extra)
