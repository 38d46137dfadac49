"""A study config (configs/study.toml), read once by the reproduce pipeline's parser, every setting checked.

The study's design lives here and nowhere else, fixed before it runs: the screen's candidates, the calibration
draws, the factorial grid (allocations x scorers x head splits), the pair of allocations the primary comparison
sets against each other, the effect the page calls meaningful and the bounds on n, and the second model's run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ripplekv.defaults import STUDY_CALIBRATED, STUDY_FIXED_ALLOCATIONS
from ripplekv.errors import UserError
from ripplekv.pipeline.reproduce.config import read_settings

GUIDE = "configs/study.toml"
KINDS = {
    "out": "text", "screen_models": "names", "screen_suites": "texts", "screen_lengths": "ints",
    "screen_limit": "count", "min_tasks": "count", "max_tasks": "count",
    "draws": "count", "calib_samples": "count", "seeds": "count", "eta": "number", "probe_tokens": "count",
    "ratios": "ratios", "sweep_budget": "budget",
    "allocations": "names", "scorers": "names", "splits": "names", "extra_methods": "names", "pair": "names",
    "budgets": "budgets", "meaningful": "number", "pilot_limit": "count", "min_limit": "count",
    "max_limit": "count", "draws_limit": "count",
    "second_methods": "names", "second_budgets": "budgets", "second_limit": "count",
}
REQUIRED = tuple(KINDS)


@dataclass(frozen=True)
class StudyConfig:
    """The settings of configs/study.toml (its comments say what each is)."""

    path: str
    out: str
    screen_models: tuple
    screen_suites: tuple
    screen_lengths: tuple
    screen_limit: int
    min_tasks: int
    max_tasks: int
    draws: int
    calib_samples: int
    seeds: int
    eta: float
    probe_tokens: int
    ratios: tuple
    sweep_budget: int
    allocations: tuple
    scorers: tuple
    splits: tuple
    extra_methods: tuple
    pair: tuple
    budgets: tuple
    meaningful: float
    pilot_limit: int
    min_limit: int
    max_limit: int
    draws_limit: int
    second_methods: tuple
    second_budgets: tuple
    second_limit: int


def load_study_config(path: str | Path) -> StudyConfig:
    """configs/study.toml, parsed and checked (UserError on the first mistake, naming the setting)."""
    values = read_settings(path, KINDS, REQUIRED, {}, GUIDE)
    config = StudyConfig(path=str(path), **values)
    allowed = (*STUDY_FIXED_ALLOCATIONS, *STUDY_CALIBRATED)
    unknown = [name for name in config.allocations if name not in allowed]
    if unknown:
        raise UserError(f"allocations: {', '.join(unknown)} cannot be a study allocation; use one of "
                        f"{', '.join(allowed)}")
    if len(config.pair) != 2 or not set(config.pair) <= set(config.allocations):
        raise UserError(f"pair = {list(config.pair)} must name two of allocations ({', '.join(config.allocations)})")
    if config.min_tasks > config.max_tasks:
        raise UserError(f"min_tasks ({config.min_tasks}) is above max_tasks ({config.max_tasks})")
    if config.min_limit > config.max_limit:
        raise UserError(f"min_limit ({config.min_limit}) is above max_limit ({config.max_limit})")
    if config.draws < 2:
        raise UserError(f"draws = {config.draws}: the calibration spread needs at least 2 draws (the issue asks 3)")
    if len(config.second_budgets) < 2:
        raise UserError("second_budgets must list at least 2 budgets")
    return config
