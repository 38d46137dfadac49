"""The placement study's verdict: the route's rank among random placements, with intervals.

Every placement (the route first) is scored on the same calibration samples, so each placement is
compared with the route by `stats.Bootstrap`'s paired bootstrap: one set of resampled samples for all
placements (the calibration samples form one stratum: there are too few per task to stratify), the
difference of mean KLs (placement - route) recomputed on each. A placement is significantly better
(worse) than the route when the difference's interval lies wholly below (above) 0.

The route's rank (1 = lowest mean KL) comes with two intervals: the bootstrap percentile interval of the
rank recomputed on each resample, and the range the significance verdicts allow, from 1 + (placements
significantly better) to 1 + (placements not significantly worse). Each verdict is one test at the
confidence level with no correction for the many placements, so about 5% of equally good placements
are expected on either side by chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ripplekv.analysis.stats import CONFIDENCE, RESAMPLES, SEED, Bootstrap, interval, p_value

STRATUM = "calibration"


@dataclass
class PlacementVerdict:
    """Per placement (the route at 0): the difference to the route, its interval, p-value and verdict."""

    difference: np.ndarray  # [P + 1] mean KL of the placement minus the route's (0 for the route)
    low: np.ndarray
    high: np.ndarray
    p: np.ndarray
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
    differences = draws - draws[0]  # [P + 1, R], paired: the same resampled samples for every placement
    low, high = interval(differences, confidence)
    p = p_value(differences)
    verdict = ["route"] + ["better" if high[i] < 0 else "worse" if low[i] > 0 else "tie" for i in range(1, count)]
    ranks = 1 + (draws[1:] < draws[0]).sum(0)
    rank_low, rank_high = interval(ranks.astype(float), confidence)
    return PlacementVerdict(point - point[0], low, high, p, verdict, 1 + int((point[1:] < point[0]).sum()),
                            float(rank_low), float(rank_high), verdict.count("better"), verdict.count("worse"),
                            samples, confidence)
