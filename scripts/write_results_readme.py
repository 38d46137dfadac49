"""Compose OUT/README.md after `make reproduce`: leaderboard, profile stability, chosen ratio, exact commands."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pandas as pd

# The make target behind each config, for the page title.
TARGETS = {"reproduce.env": "make reproduce", "quick.env": "make reproduce-quick"}


def shell_line(recorded: str) -> str:
    """A recorded command (bash `printf %q`, which escapes commas) as one would type it."""
    return shlex.join(shlex.split(recorded))


def main(out: Path, config: str, final: str | None = None) -> None:
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
    stages = ("profile", "allocate", "eval")
    commands = [shell_line((out / f".{stage}.cmd").read_text()) for stage in stages if (out / f".{stage}.cmd").is_file()]
    rho = profile.get("split_half_spearman")
    target = TARGETS.get(Path(config).name, f"bash scripts/reproduce.sh {config}")
    quick = Path(config).name == "quick.env"
    lines = [
        f"# Results of `{target}`" + (" (a quick first look)" if quick else ""),
        "",
        f"Produced by `bash scripts/reproduce.sh {config}` into `{final or out}`. Model: `{profile['model']}`.",
        *(["", "A few short samples to see the pipeline work end to end; too few to compare methods. "
           "The committed results of `make reproduce` are in `results/README.md`."] if quick else []),
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
    lines += [
        "",
        "![sensitivity](profile/sensitivity.png)",
        "![allocation](allocation.png)",
        "",
        "## Exact commands",
        "",
        "```",
        *commands,
        "```",
        "",
        "Files: `eval/predictions.jsonl` (every answer), `eval/scores.csv`, `eval/leaderboard.csv`,",
        "`eval/leaderboard_wide.csv`, `eval/ranks.csv`, `eval/lengths.csv`, `profile/sensitivity.csv`, `allocation.csv`,",
        "`eval/config.json`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
