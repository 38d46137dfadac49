"""The headline: per budget, the method closest to the full cache, the runner-up, and whether they differ.

"Closest" is the lowest mean KL to the full cache among the candidates (real methods: not the full cache,
not an answer-aware variant). Naming only a winner invites reading a tie as a win, so the runner-up (the
second-lowest mean KL) stands beside it with their paired difference (`analysis.inference`: stratified t
interval, sign-flip p, Holm over the table's budgets) and a verdict: `closer` only when the Holm-adjusted
p is below 0.05 and the interval excludes 0, else `tied` (`underpowered` where the comparison could not have
detected the meaningful effect, `inference.MEANINGFUL`). Rows with fewer samples than the leaderboard's n
are no candidates (`tables.fewer_samples`). Their scores on the informative tasks get the
same paired comparison; no score winner is picked. The pair is chosen by looking at the data, so a `closer`
here is weaker evidence than its p says; a `tied` stands.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ripplekv.analysis import inference
from ripplekv.analysis.tables import compare

COLUMNS = ["scope", "budget", "samples", "closest", "closest_kl", "runner_up", "runner_up_kl", "kl_delta", "kl_ci_low",
           "kl_ci_high", "p_kl", "p_kl_holm", "kl_verdict", "kl_mdd", "closest_score", "runner_up_score", "score_delta",
           "score_ci_low", "score_ci_high", "p_score", "p_score_holm", "score_verdict", "score_mdd"]


def closest_pairs(table: pd.DataFrame, candidate: pd.Series, kl: inference.Samples,
                  score: inference.Samples | None, scope: str, seed: int = inference.SEED) -> pd.DataFrame:
    """Per budget of `table` (rows aligned with the rows of `kl` and `score`; columns method, budget, kl and
    `score` when a score is given): the two candidates with the lowest KL and their paired comparison."""
    pairs, budgets = [], []
    for budget, group in table[candidate.to_numpy(bool) & table["budget"].notna().to_numpy()].groupby("budget", sort=True):
        if len(group) < 2:
            continue
        ordered = group.sort_values("kl", kind="stable")
        pairs.append((int(ordered.index[0]), int(ordered.index[1])))
        budgets.append(int(budget))
    if not pairs:
        return pd.DataFrame(columns=COLUMNS)
    kl_tests = compare(kl, pairs, seed=seed)
    score_tests = compare(score, pairs, seed=seed) if score is not None else None
    rows = []
    for n, (budget, (i, j)) in enumerate(zip(budgets, pairs)):
        both = np.isfinite(kl.values[i]) & np.isfinite(kl.values[j])
        row = {"scope": scope, "budget": budget, "samples": int(both.sum()),
               "closest": table.at[i, "method"], "closest_kl": float(table.at[i, "kl"]),
               "runner_up": table.at[j, "method"], "runner_up_kl": float(table.at[j, "kl"])}
        test = kl_tests.iloc[n]
        row.update(kl_delta=test["delta"], kl_ci_low=test["low"], kl_ci_high=test["high"], p_kl=test["p"],
                   p_kl_holm=test["p_holm"], kl_mdd=test["mdd"],
                   kl_verdict=inference.verdict(test["low"], test["high"], test["p_holm"], True, test["mdd"],
                                                inference.MEANINGFUL["kl"]))
        if score_tests is not None:
            test = score_tests.iloc[n]
            row.update(closest_score=float(table.at[i, "score"]), runner_up_score=float(table.at[j, "score"]),
                       score_delta=test["delta"], score_ci_low=test["low"], score_ci_high=test["high"], p_score=test["p"],
                       p_score_holm=test["p_holm"], score_mdd=test["mdd"],
                       score_verdict=inference.verdict(test["low"], test["high"], test["p_holm"], False, test["mdd"],
                                                       inference.MEANINGFUL["score"]))
        rows.append(row)
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def headline_markdown(table: pd.DataFrame) -> str:
    """The headline as markdown: one line per budget, fidelity first, differences with their intervals."""
    def paired(point, low, high, digits):
        return "–" if pd.isna(point) else f"{point:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"

    def word(value):
        return value if isinstance(value, str) and value else "–"

    def p(raw, adjusted):
        return "–" if pd.isna(raw) else f"{raw:.3g} ({adjusted:.3g})"

    lines = [{"budget": int(r.budget), "closest to full (KL)": f"`{r.closest}` {r.closest_kl:.3f}",
              "runner-up (KL)": f"`{r.runner_up}` {r.runner_up_kl:.3f}",
              "KL difference [95% CI]": paired(r.kl_delta, r.kl_ci_low, r.kl_ci_high, 3),
              "p (Holm)": p(r.p_kl, r.p_kl_holm), "verdict": word(r.kl_verdict),
              "scores (informative tasks)": "–" if pd.isna(r.closest_score) else f"{r.closest_score:.2f} vs {r.runner_up_score:.2f}",
              "score difference [95% CI]": paired(r.score_delta, r.score_ci_low, r.score_ci_high, 2),
              "score p (Holm)": p(r.p_score, r.p_score_holm), "score verdict": word(r.score_verdict)}
             for r in table.itertuples()]
    return pd.DataFrame(lines).to_markdown(index=False, disable_numparse=True) + "\n"
