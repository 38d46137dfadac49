"""The results page's calibration sections: each calibrated method's spread across calibration draws, what each
draw chose, the route's stability, and the baselines tuned on calibration prompts.

Each function takes the run folder `make reproduce` built and returns markdown lines (none when the run did not
make what the section reports); `analysis.results_page` places them on the page.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def draw_dirs(out: Path) -> list[tuple[int, Path, str]]:
    """(draw, folder, file tag) of every calibration draw the run made: draw 0 in OUT, draw d in OUT/draws/dD."""
    found = [(0, out, "")]
    for folder in sorted((out / "draws").glob("d*"), key=lambda f: f.name):
        if folder.is_dir() and folder.name[1:].isdigit():
            found.append((int(folder.name[1:]), folder, f"-{folder.name}"))
    return found


def _ratio_text(choice: dict) -> str:
    grid = ", ".join(f"{r:g}" for r in choice["candidates"])
    text = f"**{choice['ratio']:g}** of {{{grid}}}"
    if choice.get("extensions"):
        text += f" (grid extended {choice['extensions']}x past its edge)"
    return text + "".join(f"; {note}" for note in choice.get("notes", []))


def calibration_lines(out: Path) -> list[str]:
    """Each calibrated method's spread across calibration draws, beside draw 0's interval over samples, and what
    each draw chose (RippleKV's ratio, the route)."""
    from ripplekv.analysis.agreement import agreement_text, route_agreement
    from ripplekv.analysis.calibration_spread import spread_markdown

    draws = draw_dirs(out)
    path = out / "calibration_spread.csv"
    if len(draws) < 2 or not path.is_file():
        return []
    summary = pd.read_csv(path)
    lines = ["", "## Calibration draws", "",
             f"The calibration split was dealt into {len(draws)} disjoint draws (sample i of every task in draw i mod "
             f"{len(draws)}; none is an evaluation sample) and every calibrated method calibrated on each; every draw's "
             "result was evaluated on the same samples (draw 0 in `eval/`, the tables above; the others in "
             "`eval-draws/`). Beside draw 0's 95% interval over samples: each draw's mean KL, their SD and range "
             "across draws (SD / CI half-width near or above 1: the draw moves the result as much as the samples "
             "do), and each draw's paired KL difference to the uniform baseline with its verdict (t interval, sign-flip "
             "p, Holm over the method's draws: `closer` / `further` only when the adjusted p is below 0.05, `tied` "
             "otherwise). Per draw: `calibration_spread_per_draw.csv`.", ""]
    if not summary.empty:
        lines.append(spread_markdown(summary))
    choices = [(d, json.loads((folder / f"allocation{tag}.choice.json").read_text()))
               for d, folder, tag in draws if (folder / f"allocation{tag}.choice.json").is_file()]
    if choices:
        lines.append("- RippleKV's ratio, chosen on each draw's calibration prompts (teacher-forced KL at B="
                     f"{choices[0][1]['budget']}): " + "; ".join(f"draw {d} {_ratio_text(c)}" for d, c in choices) + ".")
    routes = {d: pd.read_csv(folder / "route" / "ROUTE.csv")["method"].tolist()
              for d, folder, _ in draws if (folder / "route" / "ROUTE.csv").is_file()}
    if 0 in routes and len(routes) > 1:
        lines.append("- The route's per-layer choices against draw 0's: " + "; ".join(
            f"draw {d} agrees on {agreement_text(route_agreement(routes[0], route))}"
            for d, route in routes.items() if d) + " (chance: the agreement if one route's layers were shuffled).")
    return lines


def route_stability_lines(out: Path) -> list[str]:
    """The route's split-half agreement: routes chosen on the even and odd calibration prompts apart, per draw."""
    from ripplekv.analysis.agreement import agreement_text

    halves = []
    for d, folder, _ in draw_dirs(out):
        path = folder / "route" / "route.json"
        half = json.loads(path.read_text()).get("split_half") if path.is_file() else None
        if half:
            halves.append(f"draw {d}: {half['samples'][0]} vs {half['samples'][1]} prompts agree on {agreement_text(half)}")
    if not halves:
        return []
    return ["", "Stability of the route: routes chosen on two halves of the calibration prompts (even and odd) apart, "
            "and the layers on which they name the same method, beside the agreement expected by chance (one half's "
            "layers shuffled, its method counts kept): " + "; ".join(halves) + "."]


def tuned_lines(out: Path) -> list[str]:
    """Baselines whose knobs were tuned on calibration prompts (`ripplekv tune`), and what each chose."""
    path = out / "tune.json"
    if not path.is_file():
        return []
    tuned = json.loads(path.read_text())
    rows = [{"method": f"`{base}`", "evaluated as": f"`{entry['spec']}`", "grid": f"`{entry['grid']}`",
             "choice": entry["summary"]} for base, entry in tuned["methods"].items()]
    return ["", "## Baselines tuned on calibration prompts", "",
            f"Knobs their papers tune, chosen as RippleKV's ratio is: the lowest teacher-forced KL to the full cache at "
            f"B={tuned['budget']} on {len(tuned['calibration_ids'])} calibration prompts (draw 0), the grid extended past "
            "a pick at its edge. Every point: `tune.csv`.", "", pd.DataFrame(rows).to_markdown(index=False)]
