"""The README is a guide that stays true: short, every command and option it shows parses as typed (the
cheap ones run), every link resolves, its Python example runs, and it copies no figure from results/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from ripplekv.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[list[str]]:
    """Every `ripplekv ...` command line of the README's shell blocks (continuations joined, comments dropped)."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["ripplekv"]:
                found.append(words[1:])
    return found


def test_the_readme_is_a_short_guide():
    assert len(README.splitlines()) <= 200
    assert README.index("make reproduce") < README.index("## Install")  # the two commands come first
    assert "make test" in README.split("## Install")[0]


@pytest.mark.parametrize("words", commands(), ids=lambda words: " ".join(words[:2]))
def test_every_command_parses_as_typed(words):
    """Options exist, values have their type and choices, arguments are all there: click parses each line
    exactly as the CLI would, without running it."""
    group = typer.main.get_command(app)
    command = group.commands.get(words[0])
    assert command is not None, f"ripplekv has no command {words[0]!r}"
    command.make_context(words[0], list(words[1:]))


def test_there_are_commands_to_check():
    assert {words[0] for words in commands()} >= {"methods", "tasks", "profile", "allocate", "eval", "report"}


def test_every_option_the_readme_names_exists():
    group = typer.main.get_command(app)
    known = {opt for command in group.commands.values() for param in command.params
             for opt in getattr(param, "opts", ()) if opt.startswith("--")}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", README))
    assert named, "the README names no option"
    assert sorted(named - known - {"--no-deps"}) == []


def test_the_listing_commands_run_as_typed(run_cli):
    for words in commands():
        if words[0] == "methods":
            code, out, err = run_cli(*words)
            assert code == 0 and "snapkv" in out, err


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"make ([a-z-]+)", README)):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"README names make {target}, which the Makefile lacks"


def test_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_no_figure_is_copied_from_results():
    """Measurements live in results/README.md (generated) and docs/performance.md: no decimal number here."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    prose = re.sub(r"\[[^\]]*\]\(https?://[^)]*\)", "", prose)  # citations carry arXiv ids
    assert re.findall(r"\b\d+\.\d+\b", prose) == []


def test_the_python_example_runs(tiny_model_dir, monkeypatch):
    import ripplekv

    real = ripplekv.load_model
    monkeypatch.setattr(ripplekv, "load_model", lambda *a, **k: real(str(tiny_model_dir), device="cpu", dtype="float32"))
    namespace: dict = {}
    (code,) = blocks("python")
    exec(compile(code, "README.md", "exec"), namespace)
    answers = namespace["answers"]
    assert sorted((a.method, a.budget) for a in answers if a.budget) == [
        ("snapkv", 32), ("snapkv", 64), ("streamingllm", 32), ("streamingllm", 64)]
    assert namespace["cache"].kept_entries == 64 * namespace["cache"].counts.size
