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


def depthkv_lines(out: Path) -> list[str]:
    """The DepthKV section: its eviction profile and proportional allocation (when the run made them)."""
    path = out / "profile-evict" / "profile.json"
    if not path.is_file():
        return []
    profile = json.loads(path.read_text())
    return [
        "",
        "## DepthKV profile and allocation",
        "",
        f"- Signal `{profile['signal']}` (each layer alone evicted to B={profile.get('evict_budget', '?')} by SnapKV), "
        f"{len(profile['calibration_ids'])} calibration samples, {profile['probe_tokens']} probe tokens; budgets "
        "proportional to the sensitivity (`allocate --map proportional`), H2O scores inside layers.",
        "",
        "![eviction sensitivity](profile-evict/sensitivity.png)",
        "![DepthKV allocation](depthkv.png)",
    ]


def route_lines(out: Path) -> list[str]:
    """The routing section: the route's method counts and its rank among random placements."""
    path = out / "route" / "route.json"
    if not path.is_file():
        return []
    route = json.loads(path.read_text())
    counts = ", ".join(f"{label} {count}" for label, count in route["method_counts"].items())
    rank = route.get("placement_rank")
    scored = route.get("placements_scored", 0)
    placement = (f"Among {scored} random placements with the same method counts, scored by teacher-forced KL on "
                 f"{len(route['placement_ids'])} other calibration prompts at B={route['budget']}, the profile-guided "
                 f"route ranks **{rank} of {scored + 1}** (1 = lowest KL)." if rank is not None else "No placement study was run.")
    return [
        "",
        "## Layer-wise routing",
        "",
        f"- Route (per layer, the candidate with the lowest KL when only that layer is compressed to B={route['budget']}; "
        f"{len(route['calibration_ids'])} calibration prompts): {counts}.",
        f"- {placement}",
        "",
        "![preferences](route/preferences.png)",
        "![route](route/ROUTE.png)",
        *(["![placements](route/placements.png)"] if (out / "route" / "placements.png").is_file() else []),
    ]


def long_lines(out: Path) -> list[str]:
    """The long-answer section: each method at prompt and total decode budgets (when the run made both)."""
    modes = ("prompt", "total")
    if not all((out / "long" / mode / "predictions.jsonl").is_file() for mode in modes):
        return []
    tables = []
    for mode in modes:
        rows = [json.loads(line) for line in (out / "long" / mode / "predictions.jsonl").read_text().splitlines() if line.strip()]
        frame = pd.DataFrame(rows)
        if "peak_entries" not in frame:  # prompt budgets: the kept prompt entries plus every token fed
            kept = frame["layer_budgets"].map(lambda budgets: sum(budgets) / len(budgets))
            frame["peak_entries"] = kept + frame["new_tokens"] - 1
        frame["budget"] = frame["budget"].astype("Int64")
        table = frame.groupby(["method", "budget"], dropna=False, sort=False).agg(
            n=("score", "size"), score=("score", lambda s: round(100 * s.mean(), 2)), kl=("kl", "mean"),
            new_tokens=("new_tokens", "mean"), peak=("peak_entries", "mean"))
        tables.append(table.add_prefix(f"{mode}_"))
    both = tables[0].join(tables[1], how="outer").reset_index()
    both = both.drop(columns="total_n").rename(columns={"prompt_n": "n"})
    tasks = sorted({json.loads(line)["task"] for line in (out / "long" / "total" / "predictions.jsonl").read_text().splitlines()
                    if line.strip()})
    return [
        "",
        "## Long answers under decode budgets",
        "",
        f"Task(s) {', '.join(tasks)} (answers of 100-200 tokens). `prompt`: B counts prompt entries and decoded tokens "
        "are added on top; `total`: prompt entries + decoded tokens stay at B per layer and KV head at every step, each "
        "method evicting by its own scores. `peak`: the most entries a head held after a step, mean over layers and KV "
        "heads (the full cache's is its prompt plus its answer). Score: ROUGE-L x 100; KL to the full cache along its "
        "answer (under `total`, along the answer fed one token at a time, evicting as decoding would).",
        "",
        both.to_markdown(index=False, floatfmt=".4g"),
    ]


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
    stages = ("profile", "allocate", "profile-evict", "allocate-depthkv", "route", "eval", "long-prompt", "long-total")
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
    lines += ["", "![sensitivity](profile/sensitivity.png)", "![allocation](allocation.png)", *depthkv_lines(out), *route_lines(out),
              *long_lines(out)]
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
        + ("; `long/prompt/` and `long/total/` (long answers under each decode budget)" if long_lines(out) else "") + ".",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
