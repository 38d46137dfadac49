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


def check_needle(settings: EvalSettings, lengths, depth_step: int) -> None:
    """The needle's own options, before any eval runs: one task whose lines record a needle depth (a RULER niah
    task), lengths RULER can build, a depth step within 1-100%."""
    from ripplekv.tasks import get_tasks
    from ripplekv.tasks.ruler import MAX_TARGET_TOKENS, MIN_TARGET_TOKENS

    if len(settings.tasks) != 1:
        raise UserError("needle runs one task ({task}), e.g. niah_depths", "task")
    if isinstance(depth_step, bool) or not isinstance(depth_step, int) or not 1 <= depth_step <= 100:
        raise UserError(f"{{depth_step}} must be a whole percentage from 1 to 100, got {depth_step!r}", "depth_step")
    (task,) = get_tasks(settings.suite, list(settings.tasks))
    if "depth" not in task.fields:
        raise UserError(f"task {task.name} ({settings.suite}) records no needle depth, so it has no heatmap rows: "
                        "pass {task} niah_depths or another RULER niah task", "task")
    outside = [n for n in lengths if not MIN_TARGET_TOKENS <= n <= MAX_TARGET_TOKENS]
    if outside:
        raise UserError(f"{{lengths}} must be RULER target lengths of {MIN_TARGET_TOKENS}-{MAX_TARGET_TOKENS} tokens, "
                        f"got {', '.join(map(str, outside))}", "lengths")


def run_folders(out: Path, lengths) -> list[Path]:
    return [Path(out) / f"{RUN_PREFIX}{length}" for length in lengths]


def run_needle(settings: EvalSettings, lengths, out: str | Path, console=None, depth_step: int = 10,
               workers=None) -> list[Path]:
    """Evaluate `settings` (one task) at each length into `out/tokens-<N>/`, then draw the heatmap; returns
    the heatmap files written."""
    from ripplekv.analysis import needle
    from ripplekv.pipeline.evaluate import run_eval
    from ripplekv.runs.safeio import check_output, exclusive

    check_needle(settings, lengths, depth_step)
    out = check_output(out, kind="dir", writes=WRITES + tuple(f"needle_b{b}.png" for b in settings.budgets))
    folders = run_folders(out, lengths)
    for length, folder in zip(lengths, folders):
        if console is not None:
            console.print(f"needle: {settings.tasks[0]} at {length} tokens -> {folder}", soft_wrap=True)
        # a prompt built to `length` is never cut in the middle: --max-length grows with it
        room = max(settings.max_length, length + RULER_CHAT_ROOM)
        run_eval(replace(settings, target_tokens=length, max_length=room), folder, console=console, workers=workers)
    with exclusive(out, "needle"):
        return needle.render(folders, out, settings.budgets, depth_step)
