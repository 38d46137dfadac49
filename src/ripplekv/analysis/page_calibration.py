"""The results page's sections on the calibrated methods and long answers (composed in results_page): DepthKV's
profile, allocation, predictors and headline ratio, the route, and the long answers under decode budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ripplekv.analysis.page_evals import _blank
from ripplekv.defaults import EARLIER_EVICT_METHOD


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
                f"B={profile.get('evict_budget', '?')} by `{profile.get('evict_method', EARLIER_EVICT_METHOD)}`")
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
    """How well each signal ranks layers as DepthKV's measured drop does (the predictors stage)."""
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
    columns = [c for c in ("method", "budget", "n", "kl", "agreement", "kl_delta_vs_uniform", "kl_delta_ci_low",
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
    from ripplekv.defaults import HEADLINE_PRESET, HEADLINE_VERSUS

    depthkv = sorted(m for m in labels if m.split(":")[0] == HEADLINE_PRESET)
    lines = []
    for method in depthkv:
        for versus in HEADLINE_VERSUS:
            table = head_to_head(frame, method, versus) if versus in labels else pd.DataFrame()
            if not table.empty:
                lines += ["", f"`{method}` against `{versus}` at the headline ratio ({int(table['samples'].iloc[0])} "
                          "samples, paired):", "", head_to_head_markdown(table)]
    return lines


def long_lines(out: Path, max_new_tokens: dict[str, int]) -> list[str]:
    """The long-answer section: each method at prompt and total decode budgets (when the run made both);
    `max_new_tokens`: task -> its answer's token limit."""
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
        f"Task(s) {', '.join(tasks)} (up to {max(max_new_tokens[task] for task in tasks)} new tokens). `prompt`: B counts prompt entries and decoded tokens "
        "are added on top; `total`: prompt entries + decoded tokens stay at B per layer and KV head at every step, each "
        "method evicting by its own scores. `peak`: the most entries a head held after a step, mean over layers and KV "
        "heads (the full cache's is its prompt plus its answer). Score: ROUGE-L x 100; KL to the full cache along its "
        "answer (under `total`, along the answer fed one token at a time, evicting as decoding would).",
        "",
        both.to_markdown(index=False, floatfmt=".4g"),
    ]
