"""Which tasks can tell methods apart for this model: the full cache must beat a trivial answer clearly.

A task whose full-cache score is at the floor says nothing about compression: a compressed cache that
rambles differently can score above the full cache by chance (on the bundled model, nine of ten code
answers are a repeated fence and SQuAD's are "The answer is:"). The rule, computed per run from its
own lines:

1. The trivial answer of a task is the best *constant* answer in hindsight: among the task's distinct
   full-cache predictions and gold answers (the `MAX_CANDIDATES` / 2 most frequent of each), the one whose score,
   given as the answer to every sample, is highest on average. It is chance level with the answer
   distribution known: the most frequent paragraph for retrieval, a generic line for code similarity.
2. Per sample, d = the full cache's score minus the trivial answer's score (paired: same question).
3. The task is **informative** when the one-sided 95% t lower bound of mean(d),
   `mean(d) - t_{0.95, n-1} x sd(d) / sqrt(n)`, is above 0: the full cache is above the best constant
   answer by more than this n can confuse with noise. Fewer than two samples: not informative (the
   bound is undefined).

Picking the constant in hindsight favours the trivial answer, so the rule errs toward calling a task
uninformative. Runs whose lines lack `prediction` or `answers` get no verdict (NA) and every task
counts. Uninformative tasks stay in every table, flagged; the headline's score averages leave them out.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
from scipy import stats as distributions

from ripplekv.metrics.scoring import score_sample
from ripplekv.runs.files import REFERENCE

MAX_CANDIDATES = 16  # candidates scored against every sample: 16 x n metric calls per task
ONE_SIDED = 0.95
COLUMNS = ["task", "samples", "full_score", "trivial_answer", "trivial_score", "margin", "margin_low", "informative"]


def trivial_answer(task: str, answers: list, predictions: list, all_classes: list | None = None,
                   rouge: str = "official") -> tuple[str, np.ndarray]:
    """(the best constant answer, its per-sample scores in [0, 1]) over a task's samples."""
    half = MAX_CANDIDATES // 2
    candidates = list(dict.fromkeys(
        [text for text, _ in Counter(str(p) for p in predictions).most_common(half)]
        + [text for text, _ in Counter(str(a) for gold in answers for a in gold).most_common(half)]))
    best, best_scores = "", np.zeros(len(answers))
    for text in candidates:
        scores = np.array([score_sample(task, text, gold, classes, rouge=rouge)
                           for gold, classes in zip(answers, all_classes or [None] * len(answers))])
        if scores.mean() > best_scores.mean():
            best, best_scores = text, scores
    return best, best_scores


def informative_tasks(frame: pd.DataFrame, rouge: str = "official") -> pd.DataFrame:
    """One row per task of the run (COLUMNS): the full cache's score, the trivial answer's, the margin with
    its one-sided lower bound, and the verdict (NA when the lines cannot tell)."""
    full = frame[frame["method"] == REFERENCE].drop_duplicates(["task", "id"])
    rows = []
    for task in dict.fromkeys(frame["task"]):
        lines = full[full["task"] == task].sort_values("id")
        row = {"task": task, "samples": len(lines), "full_score": np.nan, "trivial_answer": None,
               "trivial_score": np.nan, "margin": np.nan, "margin_low": np.nan, "informative": pd.NA}
        if len(lines) and {"prediction", "answers"} <= set(lines.columns) and lines["answers"].notna().all():
            classes = ([c if isinstance(c, list) else None for c in lines["all_classes"]]
                       if "all_classes" in lines else None)
            answer, trivial = trivial_answer(task, list(lines["answers"]), list(lines["prediction"].fillna("")),
                                             classes, rouge)
            own = lines["score"].to_numpy(dtype=float)
            margin = own - trivial
            n = len(margin)
            low = (margin.mean() - distributions.t.ppf(ONE_SIDED, n - 1) * margin.std(ddof=1) / np.sqrt(n)
                   if n >= 2 else np.nan)
            if n >= 2 and margin.std(ddof=1) == 0:
                low = margin.mean()
            row.update(full_score=round(100 * own.mean(), 2), trivial_answer=answer,
                       trivial_score=round(100 * trivial.mean(), 2), margin=100 * margin.mean(),
                       margin_low=100 * low, informative=bool(n >= 2 and low > 0))
        rows.append(row)
    table = pd.DataFrame(rows, columns=COLUMNS)
    table["informative"] = table["informative"].astype("boolean")
    return table


def counted_tasks(table: pd.DataFrame) -> list[str]:
    """The tasks the headline's score averages use: the informative ones, every task when none has a verdict."""
    known = table[table["informative"].notna()]
    if known.empty:
        return list(table["task"])
    return list(known.loc[known["informative"].astype(bool), "task"]) + list(table.loc[table["informative"].isna(), "task"])
