"""The placement study's verdict: the route's rank among random placements, with intervals.

Every placement (the route first) is scored on the same calibration samples, so each is compared with the
route on paired per-sample differences of KL (placement - route; the calibration samples form one stratum:
there are too few per task to stratify) by `analysis.inference`: a t interval, a sign-flip p-value and
Holm's adjustment over all the placements. A placement is significantly better (worse) than the route when
its adjusted p is below 0.05 and its interval lies wholly below (above) 0; `tie` otherwise.

The route's rank (1 = lowest mean KL) comes with two intervals: the bootstrap percentile interval of the
rank recomputed on each paired resample (`stats.Bootstrap`), and the range the verdicts allow, from 1 +
(placements significantly better) to 1 + (placements not significantly worse).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ripplekv.analysis import inference
from ripplekv.analysis.stats import CONFIDENCE, RESAMPLES, SEED, Bootstrap, interval

STRATUM = "calibration"


@dataclass
class PlacementVerdict:
    """Per placement (the route at 0): the difference to the route, its interval, p-value and verdict."""

    difference: np.ndarray  # [P + 1] mean KL of the placement minus the route's (0 for the route)
    low: np.ndarray
    high: np.ndarray
    p: np.ndarray  # sign-flip p, raw
    p_holm: np.ndarray  # Holm-adjusted over the placements
    verdict: list[str]  # "route", "better", "worse" or "tie"
    rank: int  # 1 + placements with lower mean KL than the route
    rank_low: float  # bootstrap percentile interval of the rank
    rank_high: float
    better: int  # placements significantly better than the route
    worse: int
    samples: int
    confidence: float

    @property
    def placements(self) -> int:
        return len(self.verdict) - 1

    def summary(self) -> dict:
        """What route.json and the report carry."""
        total = self.placements
        return {
            "samples": self.samples,
            "placements": total,
            "rank": self.rank,
            "rank_interval": [self.rank_low, self.rank_high],
            "rank_range_by_significance": [1 + self.better, 1 + total - self.worse],
            "significantly_better": self.better,
            "significantly_worse": self.worse,
            "share_better": self.better / total if total else None,
            "share_worse": self.worse / total if total else None,
            "confidence": self.confidence,
            "resamples": RESAMPLES,
            "test": "sign-flip, Holm-adjusted over the placements",
        }

    def line(self) -> str:
        """One sentence for the console and the results page."""
        total = self.placements
        return (f"route ranks {self.rank} of {total + 1} (bootstrap {self.confidence:.0%} interval "
                f"{self.rank_low:g}-{self.rank_high:g}) on {self.samples} samples; {self.better} of {total} placements "
                f"significantly better ({self.better / total:.0%}), {self.worse} significantly worse "
                f"({self.worse / total:.0%}): rank {1 + self.better}-{1 + total - self.worse} by significance")


def placement_verdict(kl: np.ndarray, sample_ids: list[str] | None = None, resamples: int = RESAMPLES,
                      seed: int = SEED, confidence: float = CONFIDENCE) -> PlacementVerdict:
    """The verdict from the KL matrix [samples, placements + 1] (column 0: the route)."""
    kl = np.asarray(kl, dtype=np.float64)
    samples, count = kl.shape
    if count < 2 or samples < 1:
        raise ValueError("a placement study needs the route, at least one placement and one sample")
    ids = list(sample_ids) if sample_ids is not None else [f"s{i}" for i in range(samples)]
    frame = pd.DataFrame({
        "task": STRATUM,
        "id": np.repeat(ids, count),
        "key": np.tile(np.arange(count), samples),
        "kl": kl.reshape(-1),
    })
    bootstrap = Bootstrap.draw(frame, resamples, seed)
    point, draws = bootstrap.replicates(frame, "kl", list(range(count)))
    tasks = np.zeros(samples, dtype=int)
    differences = (kl - kl[:, :1]).T  # [P + 1, samples], paired: placement minus route on each sample
    estimate = inference.t_interval(differences, tasks, confidence)
    p = np.full(count, np.nan)
    p[1:] = inference.sign_flip_p(differences[1:], tasks, seed=seed)
    p_holm = np.full(count, np.nan)
    p_holm[1:] = inference.holm(p[1:])
    words = {"closer": "better", "further": "worse", "tied": "tie"}
    verdict = ["route"] + [words[inference.verdict(estimate.low[i], estimate.high[i], p_holm[i], lower_is_better=True)]
                           for i in range(1, count)]
    ranks = 1 + (draws[1:] < draws[0]).sum(0)
    rank_low, rank_high = interval(ranks.astype(float), confidence)
    return PlacementVerdict(point - point[0], estimate.low, estimate.high, p, p_holm, verdict,
                            1 + int((point[1:] < point[0]).sum()), float(rank_low), float(rank_high),
                            verdict.count("better"), verdict.count("worse"), samples, confidence)
