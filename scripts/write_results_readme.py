"""Compose OUT/README.md after `make reproduce`: leaderboard, profile stability, chosen ratio, exact commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


def main(out: Path, config: str) -> None:
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
    commands = [(out / f".{stage}.cmd").read_text().strip() for stage in stages if (out / f".{stage}.cmd").is_file()]
    rho = profile.get("split_half_spearman")
    lines = [
        "# Results of `make reproduce`",
        "",
        f"Produced by `bash scripts/reproduce.sh {config}` (config: `{config}`). Model: `{profile['model']}`.",
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
    main(Path(sys.argv[1]), sys.argv[2])
