"""The second model's comparison on the results page: its leaderboard and whether the first model's ranking holds.

A ranking "holds" only where the data can tell: for each pair of methods both models ran at a budget, the paired
KL difference on each model (`analysis.pairs.head_to_head`: stratified t interval, sign-flip p, Holm over the
pair's budgets) is `closer`, `further`, `tied` or `underpowered`. The pair's order holds when both models order it the same way
with a decisive verdict, is reversed when both are decisive in opposite directions, and is undecided when either
model calls it tied or underpowered: a tie is never read as agreement or as a reversal.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pandas as pd

from ripplekv.analysis.pairs import head_to_head, pair_verdict
from ripplekv.analysis.report import load_predictions

BOARD_COLUMNS = ("method", "budget", "n", "fewer_samples", "kl", "kl_ci_low", "kl_ci_high", "agreement", "kl_delta_vs_uniform",
                 "kl_delta_ci_low", "kl_delta_ci_high", "p_kl_vs_uniform_holm", "kl_verdict", "avg_informative", "avg")


def _interval(point, low, high, digits: int = 3, signed: bool = False) -> str:
    if pd.isna(point):
        return "–"
    sign = "+" if signed else ""
    if low is None or pd.isna(low):  # a leaderboard without intervals (older runs): the point alone
        return f"{point:{sign}.{digits}f}"
    return f"{point:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"


def _kl_verdict(row) -> str:
    word = pair_verdict(row, "kl")
    return f"{_interval(row.kl_delta, row.kl_ci_low, row.kl_ci_high, signed=True)} {word}"


def leaderboard_markdown(board: pd.DataFrame) -> str:
    """The leaderboard with KL and its difference to the uniform baseline as intervals."""
    rows = []
    for r in board.itertuples():
        line = {"method": r.method, "B": "–" if pd.isna(r.budget) else int(r.budget)}
        if "n" in board:
            line["n"] = "–" if pd.isna(r.n) else int(r.n)
        line.update({
                "KL [95% CI]": _interval(r.kl, getattr(r, "kl_ci_low", None), getattr(r, "kl_ci_high", None))})
        if "agreement" in board:
            line["agreement"] = f"{r.agreement:.3f}"
        if "kl_delta_vs_uniform" in board:
            word = getattr(r, "kl_verdict", "")
            word = word if isinstance(word, str) else ""
            line["KL vs uniform [95% CI], Holm p"] = (
                word or "–" if pd.isna(r.kl_delta_vs_uniform) or pd.isna(r.p_kl_vs_uniform_holm) else
                f"{_interval(r.kl_delta_vs_uniform, r.kl_delta_ci_low, r.kl_delta_ci_high, signed=True)}, "
                f"{r.p_kl_vs_uniform_holm:.2g} {word}")
        for name in ("avg_informative", "avg"):
            if name in board:
                line["score (informative)" if name == "avg_informative" else "score (all)"] = (
                    "–" if pd.isna(getattr(r, name)) else f"{getattr(r, name):.2f}")
        rows.append(line)
    table = pd.DataFrame(rows)
    if "fewer_samples" not in board or not board["fewer_samples"].astype(bool).any():
        return table.to_markdown(index=False, disable_numparse=True)
    apart = board["fewer_samples"].astype(bool).to_numpy()
    return (table[~apart].to_markdown(index=False, disable_numparse=True) + "\n\nRows with fewer samples than the "
            "table's n (not ranked):\n\n" + table[apart].to_markdown(index=False, disable_numparse=True))


def ranking_across(first: Path, second: Path, names: tuple[str, str]) -> pd.DataFrame:
    """Per budget and pair `a vs b` of methods (the full cache aside) both evals ran: each model's paired KL
    difference (a minus b) with its verdict, and whether the order holds, is reversed or is undecided."""
    frames = [load_predictions(first), load_predictions(second)]
    shared = [set(zip(f["method"], f["budget"])) for f in frames]
    common = {key for key in shared[0] & shared[1] if pd.notna(key[1])}
    methods = sorted({m for m, _ in common})
    rows = []
    for a, b in combinations(methods, 2):
        tables = [head_to_head(frame, a, b) for frame in frames]
        for budget in sorted({int(x) for m, x in common if m == a} & {int(x) for m, x in common if m == b}):
            line = {"budget": budget, "pair": f"{a} vs {b}"}
            words = []
            for name, table in zip(names, tables):
                row = next(table[table["budget"] == budget].itertuples(), None)
                if row is None:
                    break
                words.append(pair_verdict(row, "kl"))
                line[f"{name}: n"] = int(row.samples)
                line[f"{name}: KL difference [95% CI]"] = _kl_verdict(row)
            if len(words) < 2:
                continue
            decisive = [w for w in words if w in ("closer", "further")]
            weak = [f"{w} on {n}" for n, w in zip(names, words) if w not in ("closer", "further")]
            line["order"] = ("undecided (" + " and ".join(weak) + ")"
                             if len(decisive) < 2 else "holds" if words[0] == words[1] else "reversed")
            rows.append(line)
    return pd.DataFrame(rows)


def second_model_lines(out: Path, folder: str = "gemma3", first_name: str = "bundled model") -> list[str]:
    """The section for OUT/FOLDER (the second model's own reproduce run, kept by `carry`), when the run made it."""
    eval_dir = out / folder / "eval"
    if not (eval_dir / "leaderboard.csv").is_file():
        return []
    board = pd.read_csv(eval_dir / "leaderboard.csv")
    config = json.loads((eval_dir / "config.json").read_text())
    samples = sum(len(ids) for ids in config.get("samples", {}).values())
    model = config.get("model", folder)
    choice_path = out / folder / "allocation.choice.json"
    ratio = json.loads(choice_path.read_text())["ratio"] if choice_path.is_file() else None
    lines = ["", f"## Second model: `{model}`", "",
             f"{samples} samples ({', '.join(config.get('samples', {}))}), RippleKV after its own profile and "
             + (f"allocation (ratio {ratio:g}, chosen on calibration prompts). " if ratio else "allocation. ")
             + "Its sliding-window layers hold their window; budgets are fitted to what each layer holds "
             "(docs/methods.md, \"Hybrid attention\"). KL to the full cache per answer token with its 95% interval; "
             "against the uniform baseline: paired difference, Holm-adjusted sign-flip p, `tied` unless p < 0.05 "
             f"and the interval excludes 0. Full outputs: `{folder}/eval/` (summary.md, leaderboard.csv).", "",
             leaderboard_markdown(board[[c for c in BOARD_COLUMNS if c in board]])]
    first = out / "eval"
    if (first / "predictions.jsonl").is_file():
        table = ranking_across(first, eval_dir, (first_name, str(model)))
        if len(table):
            counts = table["order"].str.split(" ").str[0].value_counts()
            lines += ["", "Does the ranking hold across the two models? Each pair of methods both ran, paired KL "
                      "difference on each model (`a vs b`: a minus b; negative: a is closer to the full cache). `holds`: "
                      "both models order the pair the same way, each decisively; `reversed`: decisively opposite; "
                      "`undecided`: tied or underpowered on at least one model, which supports neither reading. "
                      + ", ".join(f"{int(n)} {word}" for word, n in counts.items()) + ".", "",
                      table.to_markdown(index=False, disable_numparse=True)]
    return lines
