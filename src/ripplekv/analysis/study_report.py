"""results/study/README.md: what the study measured, its design, the verdict, and every table it rests on.

Read from what the study's stages wrote (the eval in OUT, design.json, power.json, the screen, each draw's
calibration records, draws.csv, the second model's eval); every number on the page is recomputed here from
predictions, never copied from a stage's printout.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

from ripplekv.analysis import factorial, inference, study_page
from ripplekv.analysis.results_page import nested_summary, recorded_stages, scope_lines, shell_line
from ripplekv.defaults import PIPELINE_CURVES, STUDY_CALIBRATED

QUESTION = "does spending the cache budget by layer sensitivity beat the rivals at the same memory?"
CAVEAT = ("One small model on synthetic tasks, with n set in advance for the meaningful effect below: the verdict "
          "holds for this model and these tasks, not for larger models or natural long-context tasks.")


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _summary(eval_dir: Path) -> str:
    return (nested_summary(eval_dir / "summary.md") or "(not run yet)") + "\n"


def _second_sentences(out: Path, design: dict) -> list[str]:
    """The verdict's sentences on the second model (none until its eval has a leaderboard)."""
    board = out / "second" / "leaderboard.csv"
    if not design.get("second_model") or not board.is_file():
        return []
    return study_page.second_model_sentences(pd.read_csv(board), design["second_model"], design["pair"][1],
                                             design["meaningful"])


def ids_hash(ids: list[str]) -> str:
    """A short fingerprint of the calibration prompts' ids, in order: equal hashes, the same prompts."""
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:12]


def calibration_table(out: Path, target_tokens: int | None = None) -> pd.DataFrame:
    """One row per calibrated method and draw: the prompt-id hash, prompts, tokens (prompts x target) and the
    seconds its stages took (stages.csv). `target_tokens`: the study's length, for a record that does not name
    its own (a profile.json written before profiles recorded it; every fit runs at the study's length)."""
    seconds = pd.read_csv(out / "stages.csv") if (out / "stages.csv").is_file() else pd.DataFrame(columns=["stage", "seconds"])
    took = seconds.groupby("stage")["seconds"].sum().to_dict()
    rows = []
    for folder in sorted((out / "calibration").glob("d*"), key=lambda p: int(p.name[1:])):
        draw, tag = int(folder.name[1:]), f"-{folder.name}"
        records = []
        for name, option in STUDY_CALIBRATED.items():  # where each fitter records its prompts
            if option == "allocation":
                records.append((f"{name} (profile + ratio)", folder / "profile" / "profile.json", ("profile", "allocate")))
            elif name == PIPELINE_CURVES:
                records += [(f"{name} ({path.stem.removeprefix('curve-')} curve)", path, (f"fit-{name}",))
                            for path in sorted((folder / name).glob("curve-*.json"))]
            else:
                records.append((name, folder / f"{name}{tag}.json", (f"fit-{name}",)))
        for method, path, stages in records:
            record = _read(path)
            if not record:
                continue
            ids = list(record.get("calibration_ids", []))
            target = (record.get("target_tokens") or record.get("calibration", {}).get("target_tokens")
                      or target_tokens)
            rows.append({"method": method, "draw": draw, "ids_hash": ids_hash(ids), "prompts": len(ids),
                         "tokens": len(ids) * int(target) if target else None,
                         "seconds": float(sum(took.get(f"{stage}{tag}", 0) for stage in stages))})
    return pd.DataFrame(rows, columns=["method", "draw", "ids_hash", "prompts", "tokens", "seconds"])


def study_effects(out: Path, design: dict) -> pd.DataFrame:
    """The factorial effects with their row ids (`F-B-i`), recomputed from OUT/predictions.jsonl."""
    from ripplekv.analysis.report import load_predictions

    frame = load_predictions(out / "eval")
    cells = pd.DataFrame(design["cells"], columns=["method", *factorial.FACTORS])
    first, second = design["pair"]
    table = factorial.effects(frame, cells, pair=(first, second), measure="kl", meaningful=design["meaningful"],
                              reference=design["reference"])
    return study_page.with_ids(table)


def _task_cap(design: dict, choice: dict) -> str:
    """How many informative tasks the screen found, where the study kept fewer (its max_tasks, set for cost)."""
    found = len(choice.get("tasks", ()))
    if "max_tasks" not in design or found <= len(design["tasks"]):
        return ""
    return (f" (the {len(design['tasks'])} widest-margin of the {found} informative ones: max_tasks = "
            f"{design['max_tasks']}, fixed before the screen ended, for the run's cost)")


def design_lines(design: dict, power: dict, choice: dict) -> list[str]:
    first, second = design["pair"]
    grid = factorial.complete_grid(pd.DataFrame(design["cells"], columns=["method", *factorial.FACTORS]))
    levels = {f: list(dict.fromkeys(grid[f])) for f in factorial.FACTORS}  # the grid's levels (extra rows apart)
    capped = (" - capped: at this n the meaningful effect is still out of reach, and the page says `underpowered`"
              if power.get("capped") else "")
    return [
        "## Design (fixed in configs/study.toml before the run)", "",
        f"- **Question:** {QUESTION}",
        f"- **Screen** (calibration prompts only): {choice.get('rule', '')}. Chosen: `{design['model']}`, suite "
        f"`{design['suite']}` at {design['target_tokens']} tokens, tasks {', '.join(design['tasks'])}"
        f"{_task_cap(design, choice)}.",
        f"- **Factorial:** allocation {', '.join(levels['allocation'])} x scorer {', '.join(levels['scorer'])} x head "
        f"split {', '.join(levels['split'])}, at budgets {design['budgets']}; the rows outside the grid (the full "
        "cache, LU-KV as published, ...) are in the leaderboard below. Every calibrated allocation is fitted on the "
        "same calibration prompts in each draw (the calibration table); the config says why each allocation is in "
        "the grid and which calibrated methods are not in the study.",
        f"- **Primary comparison**, one per budget, named before the run: `{second} - {first}` (KL, the pair's "
        "difference averaged over the scorer x split cells), Holm-adjusted over the budgets. Everything else is "
        "secondary: each budget's factorial table is one Holm family.",
        f"- **Meaningful effect:** a KL difference of {design['meaningful']}. **n:** {power.get('limit')} per task "
        f"({power.get('rule', '')}){capped}.",
        "- Intervals: stratified t for KL; accuracies get Wilson intervals and paired differences Tango's score "
        "interval (the nested eval summary), so none leaves [0, 100]; p-values from sign-flip tests, exact up to "
        f"{inference.EXACT_LIMIT} nonzero differences, else {inference.PERMUTATIONS:,} random sign patterns and "
        f"{inference.REFINED_PERMUTATIONS:,} where p is within a factor 2 of a threshold (a p of "
        f"{1 / (inference.PERMUTATIONS + 1):.1g} is the smallest {inference.PERMUTATIONS:,} patterns can give).", ""]


def run_time_line(out: Path) -> str:
    """The study's cost in hours, from stages.csv (a stage counts the sitting that finished it), and the code
    commits its sittings ran at (sittings.csv)."""
    times = out / "stages.csv"
    seconds = int(pd.read_csv(times)["seconds"].sum()) if times.is_file() else 0
    sittings = out / "sittings.csv"
    commits = list(dict.fromkeys(pd.read_csv(sittings)["commit"])) if sittings.is_file() else []
    code = (f" It ran in {len(pd.read_csv(sittings))} sitting(s) at commit(s) "
            f"{', '.join(f'`{c[:12]}{c[40:]}`' for c in commits)} (`sittings.csv`)." if commits else "")
    return (f"**Time:** the stages took {seconds // 3600} h {seconds % 3600 // 60} min on this machine "
            "(`stages.csv`; a stage interrupted and resumed counts the sitting that finished it; each eval's "
            "`timings.csv` has every sample's seconds; all are wall time, so a run paused while other work had the "
            f"machine counts its pause).{code}")


def _effects_figure(out: Path, effects: pd.DataFrame, design: dict) -> list[str]:
    """OUT/factorial_effects.png drawn from the table below it, and the line that shows it (none without rows)."""
    from ripplekv.analysis.study_figure import FIGURE, plot_effects

    if effects.empty:
        (out / FIGURE).unlink(missing_ok=True)
        return []
    plot_effects(effects, out / FIGURE, design["meaningful"])
    return [f"![factorial effects]({FIGURE})", ""]


def write_study_page(out: Path, final: str) -> Path:
    """OUT/README.md (see the module docstring); returns its path."""
    design, power = _read(out / "design.json"), _read(out / "power.json")
    choice = _read(out / "screen" / "screen.choice.json")
    effects = study_effects(out, design)
    first, second = design["pair"]
    primary = study_page.primary(effects, f"{second} - {first}",
                                 {int(b): design["meaningful"] for b in design["budgets"]})
    lines = [f"# The study: {QUESTION}", "", *scope_lines(out / "eval", CAVEAT)[1:], "",
             "## Verdict", "", study_page.verdict_paragraph(primary, effects, design["meaningful"],
                                                                f"allocation: {second} - {design['reference']}",
                                                                _second_sentences(out, design)),
             *design_lines(design, power, choice),
             "## Primary comparison", "", study_page.primary_markdown(primary),
             "## Factorial effects (KL; lower is closer to the full cache)", "", *_effects_figure(out, effects, design),
             study_page.factorial_markdown(effects),
             "## Calibration (the same prompts for every calibrated method in a draw)", "",
             study_page.calibration_markdown(calibration_table(out, design.get("target_tokens"))),
             "`tokens`: prompts x the study's length; `seconds`: the stages that made the file (stages.csv, wall "
             "time), so LU-KV's curves, all fitted by one stage, each show that stage's seconds.", ""]
    spread_path = out / "calibration_spread.csv"
    if spread_path.is_file():
        from ripplekv.analysis.calibration_spread import spread_markdown

        lines += ["## Spread across calibration draws", "", spread_markdown(pd.read_csv(spread_path))]
    lines += ["## Every row: fidelity, scores, informative tasks", "", _summary(out / "eval")]
    if (out / "screen" / "screen.csv").is_file():
        screen = pd.read_csv(out / "screen" / "screen.csv")
        lines += ["## The screen (full cache vs the best constant answer, calibration prompts)", "",
                  screen.to_markdown(index=False, floatfmt=".1f"), ""]
    second_model = design.get("second_model")
    lines += [f"## The second model: `{second_model}`" if second_model else "## The second model", ""]
    lines += [_summary(out / "second") if second_model else
              "No other screened model had an informative task: there is no second model's run.\n"]
    lines += ["## Commands", "", f"{run_time_line(out)} Each stage as it ran:", "", "```",
              *[shell_line((out / f".{stage}.cmd").read_text()) for stage in recorded_stages(out)], "```", "",
              f"Written by `ripplekv study {design.get('config', 'configs/study.toml')}` into `{final}`."]
    page = out / "README.md"
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return page
