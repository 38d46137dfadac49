"""Compose OUT/README.md after `make reproduce`: leaderboard, profile stability, chosen ratio, exact commands."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pandas as pd

from ripplekv.runs.files import REFERENCE, is_ceiling, run_ceilings

# The make target behind each config, for the page title.
TARGETS = {"reproduce.env": "make reproduce", "quick.env": "make reproduce-quick", "full.env": "make reproduce-full"}


def shell_line(recorded: str) -> str:
    """A recorded command (bash `printf %q`, which escapes commas) as one would type it."""
    return shlex.join(shlex.split(recorded))


def headline_lines(eval_dir: Path, title: str) -> list[str]:
    """Per budget: the real method closest to the full cache (lowest KL) and the best score, each with its
    paired interval against SnapKV, and how much of the SnapKV-to-oracle gap the closest one closes."""
    path = eval_dir / "leaderboard.csv"
    if not path.is_file():
        return []
    board = pd.read_csv(path)
    try:  # the run's own record of which variants know the answer (by name for runs written before it)
        ceilings = run_ceilings(json.loads((eval_dir / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        ceilings = None
    aware = board["method"].map(lambda m: is_ceiling(m, ceilings)).astype(bool)
    rows = []
    for budget, group in board[board["method"] != REFERENCE].groupby("budget"):
        real = group[~aware[group.index]]
        snap, ceiling = real[real["method"] == "snapkv"], group[aware[group.index]]
        if (ceiling["method"] == "oracle").any():  # the token ceiling, not the allocation ceiling beside it
            ceiling = ceiling[ceiling["method"] == "oracle"]
        if real.empty or snap.empty:
            continue
        closest, best = real.loc[real["kl"].idxmin()], real.loc[real["avg"].idxmax()]
        snap_kl = float(snap["kl"].iloc[0])
        gap = "n/a"
        if not ceiling.empty and snap_kl > float(ceiling["kl"].iloc[0]):
            share = (snap_kl - closest["kl"]) / (snap_kl - float(ceiling["kl"].iloc[0]))
            gap = f"{100 * share:.0f}% (oracle KL {float(ceiling['kl'].iloc[0]):.3f})"

        def paired(row, column, low, high, digits):
            if row["method"] == "snapkv" or pd.isna(row.get(column)):
                return "(SnapKV itself)"
            return f"{row[column]:+.{digits}f} [{row[low]:+.{digits}f}, {row[high]:+.{digits}f}]"

        rows.append({
            "budget": int(budget),
            "closest to full (lowest KL)": f"`{closest['method']}` {closest['kl']:.3f}",
            "KL vs SnapKV [95% CI]": paired(closest, "kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high", 3),
            "share of SnapKV-to-oracle KL gap closed": gap,
            "best score": f"`{best['method']}` {best['avg']:.2f}",
            "score vs SnapKV [95% CI]": paired(best, "delta_vs_uniform", "delta_ci_low", "delta_ci_high", 2),
            "oracle score (ceiling)": f"{float(ceiling['avg'].iloc[0]):.2f}" if not ceiling.empty else "n/a",
        })
    if not rows:
        return []
    return ["", f"## {title}", "",
            "Lowest mean KL to the full cache's next-token distribution among real methods (the oracle is a "
            "ceiling, not a method), and the best average score; intervals are paired bootstrap differences "
            "to SnapKV at the same budget (an interval that holds 0 is no evidence of a difference).", "",
            pd.DataFrame(rows).to_markdown(index=False)]


def allocation_lines(eval_dir: Path) -> list[str]:
    """The allocation-only table (`eval/allocation_only.csv`, written by `ripplekv report` when several methods share
    the uniform baseline's scorer), with a headline per budget: the allocator closest to the full cache and the
    share of the uniform-to-ceiling KL gap RippleKV's allocation closes."""
    path = eval_dir / "allocation_only.csv"
    if not path.is_file():
        return []
    from ripplekv.analysis.allocation import allocation_markdown, best_by_budget
    from ripplekv.defaults import ALLOCATION_METHOD

    table = pd.read_csv(path)
    headline = []
    for budget, method in best_by_budget(table).items():
        ours = table[(table["budget"] == budget) & (table["method"] == ALLOCATION_METHOD)]
        share = ours["kl_gap_closed"].iloc[0] if not ours.empty else float("nan")
        headline.append(f"- B={budget}: closest to the full cache `{method}`; `{ALLOCATION_METHOD}` closes "
                        + (f"{100 * share:.0f}%" if pd.notna(share) else "n/a") + " of the uniform-to-ceiling KL gap")
    return ["", "## Allocation only (one scorer, every allocator)", "",
            "Every method here uses the uniform baseline's scorer, so rows differ only in how the L x H_kv x B entries "
            "are spread over layers and heads; differences are paired bootstrap intervals against uniform at the same "
            "budget; 'gap closed' is the share of the uniform-to-ceiling gap (a point estimate). The ceiling, "
            "`best-of-allocations`, is per sample the lowest KL (and highest score) any allocation here reached, picked in "
            "hindsight: a bound on the allocations tried, so the gap to the best possible allocation is at least this.", "",
            *headline, "", allocation_markdown(table)]


# Methods compared head to head when a run holds both (the first against its earlier reading).
HEAD_TO_HEAD = (("gracekv", "gracekv:slots=fixed"),)


def head_to_head_lines(eval_dir: Path) -> list[str]:
    """Paired differences of each HEAD_TO_HEAD pair present in the eval, per budget with intervals."""
    board = eval_dir / "leaderboard.csv"
    present = set(pd.read_csv(board)["method"]) if board.is_file() else set()
    if not any(method in present and versus in present for method, versus in HEAD_TO_HEAD):
        return []
    from ripplekv.analysis.pairs import head_to_head, head_to_head_markdown
    from ripplekv.analysis.report import load_predictions

    frame = load_predictions(eval_dir)
    lines = []
    for method, versus in HEAD_TO_HEAD:
        table = head_to_head(frame, method, versus)
        if not table.empty:
            lines += ["", f"## `{method}` against `{versus}`", "",
                      f"Paired differences over the samples both ran (`{method}` minus `{versus}`; a positive score "
                      "and a negative KL favour the first); an interval that holds 0 is no evidence either way.", "",
                      head_to_head_markdown(table)]
    return lines


def time_lines(out: Path) -> list[str]:
    """How long each stage of this run took (OUT/stages.csv, written by scripts/reproduce.sh)."""
    path = out / "stages.csv"
    if not path.is_file():
        return []
    stages = pd.read_csv(path)
    table = stages.assign(minutes=(stages["seconds"] / 60).round(1))[["stage", "minutes"]]
    return ["", "## Time", "", f"Stages as run (a resumed stage is listed once per run), {stages['seconds'].sum() / 60:.1f} "
            "minutes in all:", "", table.to_markdown(index=False)]


def context_only_lines(out: Path) -> list[str]:
    """The context-only protocol's leaderboard (its own eval folder), when the run made it."""
    eval_dir = out / "eval-context-only"
    path = eval_dir / "leaderboard.csv"
    if not path.is_file():
        return []
    board = pd.read_csv(path)
    columns = [c for c in ("method", "budget", "avg", "avg_ci_low", "avg_ci_high", "kl", "agreement",
                           "kl_delta_vs_uniform", "kl_delta_ci_low", "kl_delta_ci_high", "headroom") if c in board]
    config = json.loads((eval_dir / "config.json").read_text())
    count = sum(len(ids) for ids in config.get("samples", {}).values())
    return [*headline_lines(eval_dir, "Headline, context-only protocol"), "",
            "## Context-only protocol",
            "",
            f"The context compressed alone (its observation window is the end of the context), the question then "
            f"read through each compressed cache, as a cache reused across questions would be (kvpress's default): "
            f"{count} samples, the first of each task's evaluation samples. Full table: `eval-context-only/`.",
            "",
            board[columns].to_markdown(index=False, floatfmt=".4g")]


def needle_lines(out: Path) -> list[str]:
    """The needle heatmap (OUT/needle, `ripplekv needle`), when the run made it: its figure and samples per cell."""
    grid_path = out / "needle" / "needle.csv"
    if not grid_path.is_file():
        return []
    grid = pd.read_csv(grid_path)
    figures = sorted(p.name for p in (out / "needle").glob("needle_b*.png"))
    full = grid[grid["budget"].isna()]
    by_length = full.groupby("length").agg(samples=("n", "sum"), accuracy=("accuracy", "mean")).reset_index()
    return ["", "## Needle by depth and length", "",
            f"RULER's niah_single_2 with the needle at each depth in turn, {int(full['n'].sum())} samples over "
            f"{len(by_length)} lengths; accuracy (top) and KL to the full cache (bottom) per method, a cell per "
            "depth and target length (blank: no sample). Grid: `needle/needle.csv`. Full cache by length:", "",
            by_length.to_markdown(index=False, floatfmt=".4g"), "",
            *[f"![needle heatmap](needle/{name})" for name in figures]]


def _rho(profile: dict) -> str:
    rho = profile.get("split_half_spearman")
    return f"{rho:.3f}" if rho is not None else "n/a"


def depthkv_lines(out: Path) -> list[str]:
    """The DepthKV section: its eviction profile and proportional allocation (when the run made them)."""
    path = out / "profile-evict" / "profile.json"
    if not path.is_file():
        return []
    profile = json.loads(path.read_text())
    if profile.get("measure") == "task-drop":
        what = (f"the drop in the task score of the greedy answer with each layer alone pruned by "
                f"{profile['prune_ratio']:.0%} by `{profile.get('evict_method')}`, DepthKV's measure")
    else:
        what = (f"the KL at {profile['probe_tokens']} probe tokens with each layer alone evicted to "
                f"B={profile.get('evict_budget', '?')} by `{profile.get('evict_method', 'snapkv')}`")
    allocation = out / "depthkv.csv"
    maps = set(pd.read_csv(allocation)["map"]) if allocation.is_file() and "map" in pd.read_csv(allocation) else set()
    bounded = next((m for m in maps if ":" in str(m)), None)
    bound = (f" bounded as `{bounded}` (ours: a layer whose drop was 0 keeps that share of B, not H2O's floor of 1 "
             "entry)") if bounded else ""
    return [
        "",
        "## DepthKV profile and allocation",
        "",
        f"- Signal `{profile['signal']}` ({what}), {len(profile['calibration_ids'])} calibration samples; split-half "
        f"Spearman rho = {_rho(profile)}; budgets proportional to the sensitivity (`allocate --map proportional`)"
        f"{bound}, H2O scores inside layers.",
        *predictor_lines(out),
        *headline_ratio_lines(out),
        "",
        "![eviction sensitivity](profile-evict/sensitivity.png)",
        "![DepthKV allocation](depthkv.png)",
    ]


def predictor_lines(out: Path) -> list[str]:
    """How well each signal ranks layers as DepthKV's measured drop does (scripts/signal_vs_drop.py)."""
    path = out / "predictors.csv"
    if not path.is_file():
        return []
    table = pd.read_csv(path)
    rows = [{"signal": row.signal, "Spearman rho with the drop [95% CI]": f"{row.spearman:.3f} [{row.low:.3f}, {row.high:.3f}]",
             "samples": f"{row.samples_drop}" + (" (paired)" if row.paired else "")} for row in table.itertuples()]
    return ["", "Which signal predicts the drop: Spearman rank correlation across layers between each signal's mean "
            "and the mean drop, bootstrap interval over calibration samples (InfoNCE enters as its mutual-information "
            "bound, so a positive rho always means the signal ranks layers as the drop does):", "",
            pd.DataFrame(rows).to_markdown(index=False)]


def headline_ratio_lines(out: Path) -> list[str]:
    """The eval at DepthKV's headline ratio (60% pruned), when the run made it."""
    path = out / "eval-headline" / "leaderboard.csv"
    if not path.is_file():
        return []
    board = pd.read_csv(path)
    columns = [c for c in ("method", "budget", "avg", "avg_ci_low", "avg_ci_high", "kl", "agreement",
                           "delta_vs_uniform", "delta_ci_low", "delta_ci_high") if c in board]
    return ["", "At DepthKV's headline ratio (60% of the prompt pruned: one budget of 0.4 x the prompts' target "
            "length; the paper compares DepthKV with uniform H2O there). Full table: `eval-headline/`.", "",
            board[columns].to_markdown(index=False, floatfmt=".4g")]


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
    study = route.get("placement_study")
    if study:  # the paired bootstrap against the route (pipeline.route): rank intervals and significant shares
        low, high = study["rank_interval"]
        first, last = study["rank_range_by_significance"]
        placement += (f" Paired bootstrap over those {study['samples']} prompts ({study['confidence']:.0%}): rank interval "
                      f"{low:g}-{high:g}; {study['significantly_better']} placements significantly better "
                      f"({study['share_better']:.0%}) and {study['significantly_worse']} significantly worse "
                      f"({study['share_worse']:.0%}), so the rank lies in {first}-{last} "
                      f"(per placement: route/placements.csv). The routing paper's route ranks 2 of 100.")
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


def max_new_tokens(tasks: list[str]) -> int:
    from ripplekv.tasks import get_tasks

    return max(task.max_new_tokens for task in get_tasks("offline", tasks))


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
        f"Task(s) {', '.join(tasks)} (up to {max_new_tokens(tasks)} new tokens). `prompt`: B counts prompt entries and decoded tokens "
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
    stages = ("profile", "allocate", "profile-evict", "allocate-depthkv", "profile-evict-kl", "profile-infonce",
              "predictors", "compresskv-profile", "route", "eval", "eval-headline", "eval-compare", "eval-context-only", "long-prompt",
              "long-total", "needle")
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
        *headline_lines(out / "eval", "Headline, with-question protocol")[1:],
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
    lines += ["", "![sensitivity](profile/sensitivity.png)", "![allocation](allocation.png)", *depthkv_lines(out), *route_lines(out),
              *head_to_head_lines(out / "eval"), *head_to_head_lines(out / "eval-compare"), *long_lines(out), *needle_lines(out), *time_lines(out)]
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
