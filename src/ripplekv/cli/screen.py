"""`ripplekv screen`: which model, tasks and prompt length a study can use, judged on calibration prompts only."""

from __future__ import annotations

from pathlib import Path

import typer

from ripplekv.cli.options import Device, Dtype, _say_written, out_option

DEFAULT_SCREEN = Path("runs/screen")
ScreenOut = out_option("Folder of the screen's cells (MODEL/SUITE-LENGTH/) and screen.csv", DEFAULT_SCREEN)


def screen_command(
    models: str = typer.Option("smollm2-135m,gemma3-270m", "--models", metavar="M,M",
                               help="Models to screen: smollm2-135m (bundled), gemma3-270m, a hub id, folder or .gguf."),
    suites: list[str] = typer.Option(["offline", "ruler"], "--suite", metavar="SUITE[:TASK,TASK]",
                                     help="A generated suite, optionally with its tasks (repeat for several)."),
    lengths: str = typer.Option("1024,2048,4096", "--lengths", metavar="N,N", help="Prompt lengths in tokens."),
    limit: int = typer.Option(8, "--limit", help="Calibration prompts per task and length."),
    min_tasks: int = typer.Option(3, "--min-tasks", help="Informative tasks the study needs at its length."),
    out: ScreenOut = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
) -> None:
    """The full cache against the best constant answer, per model x task x length, on calibration prompts."""
    from rich.console import Console

    from ripplekv.engine.packaged import names_bundled
    from ripplekv.pipeline import eval_plan
    from ripplekv.pipeline.needle import parse_lengths
    from ripplekv.pipeline.screen import CHOICE_JSON, SCREEN_CSV, ScreenSettings, run_screen

    console = Console(stderr=True)
    out_dir = Path(out) if out else DEFAULT_SCREEN
    names = eval_plan.parse_names(models, "--models")
    settings = ScreenSettings(
        models=tuple(None if names_bundled(name) else name for name in names),
        suites=tuple(parse_suite(text) for text in suites),
        lengths=tuple(parse_lengths(lengths)), limit=limit, min_tasks=min_tasks, device=device, dtype=dtype)
    console.print(f"screen: writing to {out_dir}" + ("" if out else " (the default; choose with --out)"), soft_wrap=True)
    table = run_screen(settings, out_dir, console=console)
    console.print(table.to_string(index=False), markup=False)
    _say_written(console, [out_dir / SCREEN_CSV, out_dir / CHOICE_JSON])


def parse_suite(text: str) -> tuple[str, tuple[str, ...]]:
    """`ruler:vt,cwe` -> ("ruler", ("vt", "cwe")); `offline` -> ("offline", ()) (all its tasks)."""
    from ripplekv.defaults import GENERATED_SUITES
    from ripplekv.errors import UserError
    from ripplekv.pipeline.eval_plan import parse_names

    suite, _, tasks = text.partition(":")
    if suite not in GENERATED_SUITES:
        raise UserError(f"--suite {text!r}: the screen reads calibration prompts, which only the generated "
                        f"suites have ({', '.join(GENERATED_SUITES)})")
    return suite, parse_names(tasks) if tasks else ()
