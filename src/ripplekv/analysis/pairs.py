"""Two methods head to head: their paired score and KL differences at each budget, with intervals.

The leaderboard pairs every method with the uniform baseline; a question like "does GraceKV as published beat
its fixed-slot reading" pairs two methods directly, on the same resampled samples (`stats.Bootstrap`).
"""

from __future__ import annotations

import pandas as pd

from ripplekv.analysis import stats

COLUMNS = ["budget", "method", "versus", "samples", "score_delta", "score_ci_low", "score_ci_high",
           "kl_delta", "kl_ci_low", "kl_ci_high"]


def head_to_head(frame: pd.DataFrame, method: str, versus: str, resamples: int = stats.RESAMPLES,
                 seed: int = stats.SEED) -> pd.DataFrame:
    """Per budget both methods ran at: `method` minus `versus` (score x 100 as the leaderboard, KL per answer
    token), point and 95% interval, over the samples both have. Empty when they share no budget."""
    rows = []
    for budget, group in frame[frame["method"].isin([method, versus]) & frame["budget"].notna()].groupby("budget"):
        both = group.groupby(["task", "id"])["method"].transform("nunique") == 2
        group = group[both]
        if group.empty:
            continue
        group = group.assign(key=group["method"])
        boot = stats.Bootstrap.draw(group, resamples, seed)
        line = {"budget": int(budget), "method": method, "versus": versus, "samples": int(both.sum() // 2)}
        for column, name, scale in (("score", "score", 100.0), ("kl", "kl", 1.0)):
            point, draws = boot.replicates(group, column, [method, versus])
            low, high = stats.interval(scale * (draws[0] - draws[1]))
            line.update({f"{name}_delta": float(scale * (point[0] - point[1])), f"{name}_ci_low": float(low),
                         f"{name}_ci_high": float(high)})
        rows.append(line)
    return pd.DataFrame(rows, columns=COLUMNS)


def head_to_head_markdown(table: pd.DataFrame) -> str:
    """The table as markdown, differences with their intervals."""
    lines = [{"budget": int(r.budget), "samples": int(r.samples),
              f"score, {r.method} - {r.versus} [95% CI]": f"{r.score_delta:+.2f} [{r.score_ci_low:+.2f}, {r.score_ci_high:+.2f}]",
              f"KL, {r.method} - {r.versus} [95% CI]": f"{r.kl_delta:+.3f} [{r.kl_ci_low:+.3f}, {r.kl_ci_high:+.3f}]"}
             for r in table.itertuples()]
    return pd.DataFrame(lines).to_markdown(index=False) + "\n"
