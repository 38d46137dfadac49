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
    commands = [(out / f".{stage}.cmd").read_text().strip() for stage in ("profile", "allocate") if (out / f".{stage}.cmd").is_file()]
    eval_config = json.loads((out / "eval" / "config.json").read_text()) if (out / "eval" / "config.json").is_file() else {}
    rho = profile.get("split_half_spearman")
    lines = [
        "# Results of `make reproduce`",
        "",
        f"Produced by `bash scripts/reproduce.sh {config}` (config: `{config}`). Model: `{profile['model']}`.",
        "",
        "## Leaderboard",
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
        "ripplekv eval " + " ".join(eval_config.get("argv", [])) if eval_config.get("argv") else "(eval: see eval/config.json)",
        "```",
        "",
        "Files: `eval/predictions.jsonl` (every answer), `eval/scores.csv`, `eval/leaderboard.csv`,",
        "`eval/leaderboard_wide.csv`, `profile/sensitivity.csv`, `allocation.csv`, `eval/config.json`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
