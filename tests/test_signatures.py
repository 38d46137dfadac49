"""Settings travel as objects, not long argument lists; scripts stand on the package, never on the tests.

Beside tests/test_structure.py's layering rules: no library function takes more than `MAX_PARAMETERS` (the Typer
commands in cli/ and the public api.py are exempt: their parameters are the options a user types); no name in
`ONE_MEANING` is defined twice; no file in scripts/ imports from tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ripplekv"
MAX_PARAMETERS = 10
EXEMPT = ("cli/", "api.py")
# Names that once meant two different things in two modules; each now has one definition.
ONE_MEANING = ("file_sha256", "load_predictions", "read_sensitivity")


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    """Every parameter a caller can pass (positional, keyword-only, *args, **kwargs); a method's self/cls is not one."""
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + (args.vararg is not None) + (
        args.kwarg is not None)
    first = (args.posonlyargs + args.args)[:1]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    return count - (1 if in_class and first and not static else 0)


def long_signatures(root: Path) -> list[str]:
    """`path:line name(N)` for every function under `root` (outside the exempt places) with too many parameters."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(EXEMPT):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        methods = {id(item) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for item in node.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = parameter_count(node, id(node) in methods)
                if count > MAX_PARAMETERS:
                    found.append(f"{relative}:{node.lineno} {node.name}({count})")
    return found


def test_no_library_function_takes_more_than_ten_parameters():
    """More than ten settings in one signature is a settings object waiting to be written (`EvalSettings`,
    `tasks.calibration.Calibration`, `pipeline.model_choice.ModelChoice`, `AllocateSettings` ...)."""
    assert long_signatures(SRC) == []


def test_the_signature_check_can_fail(tmp_path):
    (tmp_path / "cli").mkdir()
    many = ", ".join(f"a{i}" for i in range(11))
    (tmp_path / "lib.py").write_text(f"def f({many}):\n    pass\n\n\nclass C:\n    def m(self, {many[:-5]}):\n"
                                     f"        pass\n\n    def n(self, *args, **kwargs):\n        pass\n")
    (tmp_path / "cli" / "command.py").write_text(f"def command({many}):\n    pass\n")
    (tmp_path / "api.py").write_text(f"def generate({many}):\n    pass\n")
    assert long_signatures(tmp_path) == ["lib.py:1 f(11)"]  # m has ten besides self; cli/ and api.py are exempt


@pytest.mark.parametrize("name", ONE_MEANING)
def test_a_clashing_name_is_defined_once(name):
    defined = [f"{path.relative_to(SRC).as_posix()}:{node.lineno}"
               for path in sorted(SRC.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]
    assert len(defined) <= 1, defined


def imports_of_tests(folder: Path) -> list[str]:
    """`file:line` for every import of the tests package in `folder`'s Python files."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "tests" or name.startswith("tests.") for name in names):
                found.append(f"{path.relative_to(folder).as_posix()}:{node.lineno}")
    return found


def test_scripts_never_import_tests(tmp_path):
    """Tests may import scripts or the package; a script that imports tests would need the repository on its path."""
    assert imports_of_tests(ROOT / "scripts") == []
    (tmp_path / "bench.py").write_text("import json\nfrom tests.naive_profile import profile\n")
    assert imports_of_tests(tmp_path) == ["bench.py:2"]
