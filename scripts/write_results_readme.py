"""Compose OUT/README.md after `make reproduce`: leaderboard, profile stability, chosen ratio, exact commands."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pandas as pd

from ripplekv.analysis.calibration_report import calibration_lines, draw_dirs, route_stability_lines, tuned_lines
from ripplekv.analysis.second_model import second_model_lines

# The make target behind each config, for the page title.
TARGETS = {"reproduce.env": "make reproduce", "quick.env": "make reproduce-quick", "full.env": "make reproduce-full",
           "gemma3.env": "make reproduce-gemma"}


def shell_line(recorded: str) -> str:
    """A recorded command (bash `printf %q`, which escapes commas) as one would type it."""
    return shlex.join(shlex.split(recorded))


def _blank(table: pd.DataFrame) -> pd.DataFrame:
    """Missing cells as None, which markdown shows as a dash (a NaN would read "nan")."""
    return table.astype(object).where(table.notna(), None)


def _paired(point, low, high, digits: int) -> str:
    return "–" if pd.isna(point) else f"{point:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _p(raw, adjusted) -> str:
    return "–" if pd.isna(raw) else f"{raw:.2g} (Holm {adjusted:.2g})"


def _word(value) -> str:
    return value if isinstance(value, str) and value else "–"


def _headline_table(rows: pd.DataFrame, board: pd.DataFrame | None) -> str:
    """Per budget: closest to full and the runner-up by KL, their paired difference, p (Holm) and verdict;
    the closest one against the uniform baseline (from the leaderboard); both scores on informative tasks."""
    lines = []
    for r in rows.itertuples():
        line = {"budget": int(r.budget), "closest to full (KL)": f"`{r.closest}` {r.closest_kl:.3f}",
                "runner-up (KL)": f"`{r.runner_up}` {r.runner_up_kl:.3f}",
                "KL difference [95% CI]": _paired(r.kl_delta, r.kl_ci_low, r.kl_ci_high, 3),
                "p": _p(r.p_kl, r.p_kl_holm), "verdict": _word(r.kl_verdict)}
        if board is not None:
            own = board[(board["method"] == r.closest) & (board["budget"] == r.budget)]
            if len(own) and pd.notna(own["kl_delta_vs_uniform"].iloc[0]):
                o = own.iloc[0]
                line[f"closest vs `{o['versus']}`: KL [95% CI], verdict"] = (
                    f"{_paired(o['kl_delta_vs_uniform'], o['kl_delta_ci_low'], o['kl_delta_ci_high'], 3)} {_word(o['kl_verdict'])}")
        line["scores, informative tasks (closest vs runner-up)"] = (
            "–" if pd.isna(r.closest_score) else
            f"{r.closest_score:.2f} vs {r.runner_up_score:.2f}: {_paired(r.score_delta, r.score_ci_low, r.score_ci_high, 2)}, "
            f"{_word(r.score_verdict)}")
        lines.append(line)
    return pd.DataFrame(lines).to_markdown(index=False)


def _tied_sentence(rows: pd.DataFrame) -> str:
    """Which budgets' closest method the data cannot tell from its runner-up."""
    tied = [f"B={int(r.budget)}" for r in rows.itertuples() if r.kl_verdict == "tied"]
    if not tied:
        return "At every budget the closest method is closer than its runner-up (Holm-adjusted p < 0.05)."
    return (f"Tied at {', '.join(tied)}: there the closest method and the runner-up are tied (the interval holds 0 or "
            "the adjusted p is 0.05 or more), so neither is the winner.")


def headline_lines(eval_dir: Path, title: str) -> list[str]:
    """The eval's headline.csv (`ripplekv report`): per budget, the real method closest to the full cache, the
    runner-up and whether they differ; and which tasks the score averages use."""
    path = eval_dir / "headline.csv"
    if not path.is_file():
        return []
    table = pd.read_csv(path)
    rows = table[table["scope"] == "all methods"]
    if rows.empty:
        return []
    board = pd.read_csv(eval_dir / "leaderboard.csv") if (eval_dir / "leaderboard.csv").is_file() else None
    lines = ["", f"## {title}", "",
             "Fidelity first: per budget, the real method with the lowest mean KL to the full cache (answer-aware "
             "variants excluded), the runner-up, and their paired difference: stratified t interval, sign-flip "
             "permutation p, Holm-adjusted over the budgets. `closer` only where the adjusted p < 0.05 and the "
             "interval excludes 0, else `tied`. Scores are on the informative tasks only, compared the same way; no "
             "score winner is named.", "", _headline_table(rows, board), "", _tied_sentence(rows)]
    lines += informative_lines(eval_dir)
    return lines


def memory_lines(out: Path) -> list[str]:
    """The memory axis (OUT/eval-memory, when MEMORY_METHODS ran): per budget, the way of spending its bytes
    closest to the full cache against the runner-up (tied where their interval holds 0), then every variant."""
    run = out / "eval-memory"
    table = run / "memory_axis.md"
    if not table.is_file():
        return []
    lines = headline_lines(run, "Memory axis: the best way found to spend each budget's bytes")
    body = [line for line in table.read_text().splitlines() if not line.startswith("## ")]
    return lines + ["", "Every variant at matched bytes (`eval-memory/memory_axis.csv`):", *body,
                    "![memory axis](eval-memory/memory_axis.png)"]


def informative_lines(eval_dir: Path) -> list[str]:
    """One sentence: the tasks that count in the score averages and those flagged out, with their numbers."""
    path = eval_dir / "informative.csv"
    if not path.is_file():
        return []
    table = pd.read_csv(path)
    known = table[table["informative"].notna()]
    if known.empty:
        return []
    yes = [t for t, v in zip(known["task"], known["informative"]) if str(v) == "True"]
    no = known[known["informative"].astype(str) == "False"]
    flagged = "; ".join(f"{r.task} (full cache {r.full_score:.2f}, best constant answer {r.trivial_score:.2f})"
                        for r in no.itertuples())
    return ["", f"Informative tasks (the full cache beats the best constant answer, one-sided 95%): {', '.join(yes) or 'none'}."
            + (f" Flagged, kept in the tables but out of the score averages: {flagged}." if flagged else "")]


def allocation_lines(eval_dir: Path) -> list[str]:
    """The allocation-only table (`eval/allocation_only.csv`, written by `ripplekv report` when several methods share
    the uniform baseline's scorer), with its headline: per budget the allocator closest to the full cache and the
    runner-up, and RippleKV's share of the gap to the best of the other allocations."""
    path = eval_dir / "allocation_only.csv"
    if not path.is_file():
        return []
    from ripplekv.analysis.allocation import allocation_markdown
    from ripplekv.defaults import ALLOCATION_METHOD

    table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    table["picks"] = table["picks"].fillna("")
    table["verdict"] = table["verdict"].fillna("")
    table["kl_verdict"] = table["kl_verdict"].fillna("")
    headline = pd.read_csv(eval_dir / "headline.csv") if (eval_dir / "headline.csv").is_file() else pd.DataFrame()
    rows = headline[headline["scope"] == "allocation only"] if len(headline) else headline
    names = [f"`{m}`" for m in dict.fromkeys(table.loc[table["kind"] == "answer-aware", "method"])]
    aware = (", ".join(names) + (" are" if len(names) > 1 else " is")) if names else ""
    shares = []
    for budget, group in table.groupby("budget"):
        ours = group[group["method"] == ALLOCATION_METHOD]
        if len(ours) and pd.notna(ours["kl_gap_share"].iloc[0]):
            shares.append(f"B={int(budget)} {100 * ours['kl_gap_share'].iloc[0]:.0f}%")
    return ["", "## Allocation only (one scorer, every allocator)", "",
            "Every method here uses the uniform baseline's scorer, so rows differ only in how the L x H_kv x B entries "
            "are spread over layers and heads; each is paired against uniform at the same budget (t interval, sign-flip "
            "p, Holm over the table). " + (f"{aware} answer-aware: an allocation chosen from the answer's attention, "
                                           "neither a method nor a bound. " if aware else "")
            + "`best-of-allocations` is a hindsight bound on selectors: per "
            "sample the lowest KL any allocation here reached. No allocator is judged against a best-of that contains "
            "it: `KL gap share` is the share of uniform's KL gap to the best of the *other* allocations (leave-one-out, "
            "a point estimate). `cross-fit choice` is an honest selector: the allocator with the lowest KL on one half "
            "of each task's samples, measured on the other half, both ways.", "",
            *([_headline_table(rows, None), "", _tied_sentence(rows)] if len(rows) else []),
            *([f"`{ALLOCATION_METHOD}`'s share of uniform's KL gap to the best of the other allocations: "
               + ", ".join(shares) + " (above 100%: closer than that per-sample best of the others on average)."]
              if shares else []),
            "", allocation_markdown(table)]


# Methods compared head to head when a run holds both (GraceKV against its earlier reading, each against SnapKV).
HEAD_TO_HEAD = (("gracekv", "gracekv:slots=fixed"), ("gracekv", "snapkv"), ("gracekv:slots=fixed", "snapkv"))


def head_to_head_lines(eval_dir: Path) -> list[str]:
    """Paired differences of each HEAD_TO_HEAD pair present in the eval, per budget with intervals."""
    board = eval_dir / "leaderboard.csv"
    present = set(pd.read_csv(board)["method"]) if board.is_file() else set()
    if not any(method in present and versus in present for method, versus in HEAD_TO_HEAD):
        return []
    from ripplekv.analysis.informative import counted_tasks
    from ripplekv.analysis.pairs import head_to_head, head_to_head_markdown
    from ripplekv.analysis.report import load_predictions

    frame = load_predictions(eval_dir)
    informative = eval_dir / "informative.csv"
    counted = counted_tasks(pd.read_csv(informative, dtype={"informative": "boolean"})) if informative.is_file() else None
    lines = []
    for method, versus in HEAD_TO_HEAD:
        table = head_to_head(frame, method, versus, counted=counted)
        if not table.empty:
            lines += ["", f"## `{method}` against `{versus}`", "",
                      f"Paired differences over the samples both ran (`{method}` minus `{versus}`; a negative KL and a "
                      "positive score favour the first; scores on the informative tasks): t interval, sign-flip p, Holm "
                      "over the budgets; `tied` unless the adjusted p < 0.05 and the interval excludes 0.", "",
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
    columns = [c for c in ("method", "budget", "kl", "agreement", "kl_delta_vs_uniform", "kl_delta_ci_low",
                           "kl_delta_ci_high", "p_kl_vs_uniform_holm", "kl_verdict", "avg_informative", "avg") if c in board]
    config = json.loads((eval_dir / "config.json").read_text())
    count = sum(len(ids) for ids in config.get("samples", {}).values())
    return [*headline_lines(eval_dir, "Headline, context-only protocol"), "",
            "## Context-only protocol",
            "",
            f"The context compressed alone (its observation window is the end of the context), the question then "
            f"read through each compressed cache, as a cache reused across questions would be (kvpress's default): "
            f"{count} samples, the first of each task's evaluation samples. Full table: `eval-context-only/`.",
            "",
            _blank(board[columns]).to_markdown(index=False, floatfmt=".4g", missingval="–")]


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
    columns = [c for c in ("method", "budget", "kl", "agreement", "kl_delta_vs_uniform", "kl_delta_ci_low",
                           "kl_delta_ci_high", "p_kl_vs_uniform_holm", "kl_verdict", "avg_informative", "delta_vs_uniform",
                           "delta_ci_low", "delta_ci_high", "p_vs_uniform_holm", "verdict") if c in board]
    return ["", "At DepthKV's headline ratio (60% of the prompt pruned: one budget of 0.4 x the prompts' target "
            "length; the paper compares DepthKV with uniform H2O there). Full table: `eval-headline/`.", "",
            _blank(board[columns]).to_markdown(index=False, floatfmt=".4g", missingval="–")]


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


# ---- DepthKV against the baselines its paper compares with (#42; the calibration draws' sections: analysis.calibration_report)


def depthkv_versus_lines(out: Path) -> list[str]:
    """DepthKV against uniform H2O (its paper's comparison) and SnapKV, paired, at its headline ratio."""
    eval_dir = out / "eval-headline"
    if not (eval_dir / "predictions.jsonl").is_file():
        return []
    from ripplekv.analysis.pairs import head_to_head, head_to_head_markdown
    from ripplekv.analysis.report import load_predictions

    frame = load_predictions(eval_dir)
    labels = set(frame["method"])
    depthkv = sorted(m for m in labels if m.split(":")[0] == "depthkv")
    lines = []
    for method in depthkv:
        for versus in ("h2o", "snapkv"):
            table = head_to_head(frame, method, versus) if versus in labels else pd.DataFrame()
            if not table.empty:
                lines += ["", f"`{method}` against `{versus}` at the headline ratio ({int(table['samples'].iloc[0])} "
                          "samples, paired):", "", head_to_head_markdown(table)]
    return lines


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
              "compresskv-profile", "route", "predictors", "tune", "eval", "eval-draws", "eval-headline", "eval-compare",
              "eval-context-only", "eval-memory", "long-prompt", "long-total", "needle", "gemma-profile", "gemma-allocate", "gemma-eval")
    draw_stages = [f"{stage}-d{d}" for d, _, _ in draw_dirs(out)[1:] for stage in stages[:8]]  # draws 1.. (#42)
    stages = stages[:8] + tuple(draw_stages) + stages[8:]
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
              *long_lines(out), *needle_lines(out), *second_model_lines(out, "gemma3", profile["model"]),
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
        + ("; `long/prompt/` and `long/total/` (long answers under each decode budget)" if long_lines(out) else "") + ".",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
