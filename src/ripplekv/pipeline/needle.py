"""`ripplekv needle`: a needle task evaluated at several context lengths, then the depth x length heatmap.

Each length is an ordinary eval run in `<out>/tokens-<N>/` (resumable and growable like any `eval`, with the
same methods, budgets and seed); the heatmap (`analysis.needle`) is drawn from those runs alone into `<out>/`:
`needle.csv` (the grid) and `needle_b<B>.png` per budget. The default task, RULER's niah_single_2 with the
needle at depths 0-100% in turn (`niah_depths`), gives one depth per sample, so `--limit 11` fills every
depth at every length once.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.pipeline.eval_plan import RULER_CHAT_ROOM, EvalSettings

RUN_PREFIX = "tokens-"
WRITES = ("needle.csv", "index.html")


def parse_lengths(text: str) -> tuple[int, ...]:
    """`"1000,2000"` -> (1000, 2000): positive integers, each once, in increasing order."""
    try:
        values = sorted({int(part) for part in text.replace(" ", ",").split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--lengths takes comma-separated token counts, e.g. 1000,2000; got {text!r}") from None
    if not values or values[0] < 1:
        raise UserError(f"--lengths takes positive token counts, e.g. 1000,2000; got {text!r}")
    return tuple(values)


def run_folders(out: Path, lengths) -> list[Path]:
    return [Path(out) / f"{RUN_PREFIX}{length}" for length in lengths]


def run_needle(settings: EvalSettings, lengths, out: str | Path, console=None, depth_step: int = 10,
               workers=None) -> list[Path]:
    """Evaluate `settings` (one task) at each length into `out/tokens-<N>/`, then draw the heatmap; returns
    the heatmap files written."""
    from ripplekv.analysis import needle
    from ripplekv.pipeline.evaluate import run_eval
    from ripplekv.runs.safeio import check_output, exclusive

    out = check_output(out, kind="dir", writes=WRITES + tuple(f"needle_b{b}.png" for b in settings.budgets))
    if len(settings.tasks) != 1:
        raise UserError("needle runs one task (--task), e.g. niah_depths")
    if depth_step < 1:
        raise UserError(f"--depth-step must be a positive percentage, got {depth_step}")
    folders = run_folders(out, lengths)
    for length, folder in zip(lengths, folders):
        if console is not None:
            console.print(f"needle: {settings.tasks[0]} at {length} tokens -> {folder}", soft_wrap=True)
        # a prompt built to `length` is never cut in the middle: --max-length grows with it
        room = max(settings.max_length, length + RULER_CHAT_ROOM)
        run_eval(replace(settings, target_tokens=length, max_length=room), folder, console=console, workers=workers)
    with exclusive(out, "needle"):
        return needle.render(folders, out, settings.budgets, depth_step)
