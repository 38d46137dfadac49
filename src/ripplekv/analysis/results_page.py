"""The results page of `ripplekv reproduce` (OUT/README.md): headline, leaderboard, profiles, chosen ratio, the
calibrated methods' sections, time, and the exact commands each stage ran. Its sections live in page_evals,
page_calibration, calibration_report and second_model; this module puts them in order."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pandas as pd

from ripplekv.analysis.calibration_report import calibration_lines, route_stability_lines, tuned_lines
from ripplekv.analysis.page_calibration import depthkv_lines, depthkv_versus_lines, long_lines, route_lines
from ripplekv.analysis.page_evals import (
    allocation_lines,
    context_only_lines,
    head_to_head_lines,
    headline_lines,
    memory_lines,
    needle_lines,
    time_lines,
)
from ripplekv.analysis.second_model import second_model_lines

# The make target behind each config, for the page title.
TARGETS = {"reproduce.toml": "make reproduce", "quick.toml": "make reproduce-quick", "full.toml": "make reproduce-full",
           "gemma3.toml": "make reproduce-gemma"}


def shell_line(recorded: str) -> str:
    """A recorded command as one would type it (records of the earlier bash runner, `printf %q`, escape commas)."""
    return shlex.join(shlex.split(recorded))


def recorded_stages(out: Path) -> list[str]:
    """The stages whose command `out` recorded (`.STAGE.cmd`), in the order they ran (stages.csv), any other
    record after them by name."""
    ran = list(dict.fromkeys(pd.read_csv(out / "stages.csv")["stage"])) if (out / "stages.csv").is_file() else []
    others = sorted(path.name[1:-len(".cmd")] for path in out.glob(".*.cmd"))
    return [stage for stage in dict.fromkeys(ran + others) if (out / f".{stage}.cmd").is_file()]


def write_results_page(out: Path, config: str, final: str | None = None,
                       max_new_tokens: dict[str, int] | None = None) -> None:
    """OUT/README.md from what the run in `out` holds; `config` names the run's config, `final` the folder the
    run ends up in (the staging folder is `out` while the pipeline runs), `max_new_tokens` each long-answer
    task's answer limit (task -> tokens; the tasks are below this layer)."""
    max_new_tokens = max_new_tokens or {}
    profile = json.loads((out / "profile" / "profile.json").read_text())
    choice_path = out / "allocation.choice.json"
    choice = json.loads(choice_path.read_text()) if choice_path.is_file() else None
    summary = (out / "eval" / "summary.md").read_text() if (out / "eval" / "summary.md").is_file() else ""
    # Nest the eval summary under this page: drop its title and its images (linked again below).
    summary = "\n".join(
        ("#" + line if line.startswith("## ") else line)
        for line in summary.splitlines()
        if not line.startswith("# ") and not line.startswith("![")
    )
    commands = [shell_line((out / f".{stage}.cmd").read_text()) for stage in recorded_stages(out)]
    rho = profile.get("split_half_spearman")
    target = TARGETS.get(Path(config).name, f"ripplekv reproduce {config}")
    quick = Path(config).name == "quick.toml"
    lines = [
        f"# Results of `{target}`" + (" (a quick first look)" if quick else ""),
        "",
        f"Produced by `ripplekv reproduce {config}` into `{final or out}`. Model: `{profile['model']}`.",
        *(["", "A few short samples to see the pipeline work end to end; too few to compare methods. "
           "The committed results of `make reproduce` are in `results/README.md`."] if quick else []),
        "",
        *headline_lines(out / "eval", "Headline, with-question protocol")[1:],
        *memory_lines(out),
        *allocation_lines(out / "eval"),
        "",
        "## Evaluation",
        "",
        summary.strip(),
        "",
        "![score vs budget](eval/score_vs_budget.png)",
        "![fidelity vs budget](eval/kl_vs_budget.png)",
        "![per-layer budgets](eval/layer_budgets.png)",
        "",
        "## RippleKV profile and allocation",
        "",
        f"- Signal `{profile['signal']}`, eta {profile['eta']}, {len(profile['calibration_ids'])} calibration samples "
        f"x {profile['seeds']} seed(s), {profile['probe_tokens']} probe tokens; split-half Spearman rho = "
        + (f"{rho:.3f}" if rho is not None else "n/a"),
    ]
    if choice:
        sweep = pd.read_csv(out / "allocation.sweep.csv")
        lines += [
            f"- Ratio chosen on the calibration split: **{choice['ratio']:g}** among {choice['candidates']} "
            f"(teacher-forced KL to the full cache at B={choice['budget']}):",
            "",
            sweep.to_markdown(index=False, floatfmt=".4g"),
        ]
    lines += context_only_lines(out)
    lines += ["", "![sensitivity](profile/sensitivity.png)", "![allocation](allocation.png)", *depthkv_lines(out),
              *depthkv_versus_lines(out), *route_lines(out), *route_stability_lines(out), *calibration_lines(out),
              *tuned_lines(out), *head_to_head_lines(out / "eval"), *head_to_head_lines(out / "eval-compare"),
              *long_lines(out, max_new_tokens), *needle_lines(out), *second_model_lines(out, "gemma3", profile["model"]),
              *time_lines(out)]
    lines += [
        "",
        "## Exact commands",
        "",
        "```",
        *commands,
        "```",
        "",
        "Files: `eval/predictions.jsonl` (every answer), `eval/scores.csv`, `eval/leaderboard.csv`,",
        "`eval/leaderboard_wide.csv`, `eval/ranks.csv`, `eval/lengths.csv`, `profile/sensitivity.csv`, `allocation.csv`,",
        "`eval/config.json`" + ("; `profile-evict/` and `depthkv.csv` (DepthKV)" if (out / "depthkv.csv").is_file() else "")
        + ("; `route/` (ROUTE.csv, preferences.csv, placements.csv, route.json)" if (out / "route" / "route.json").is_file() else "")
        + ("; `long/prompt/` and `long/total/` (long answers under each decode budget)" if long_lines(out, max_new_tokens) else "") + ".",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
