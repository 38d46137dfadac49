"""check-references' quantizer tolerance (scripts/check_references_quant.py): each number's step and what counts as
the same quantization level, on tiny arrays (optimum-quanto itself runs only in the reference venv)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from check_references_quant import agreement, group_steps, merged  # noqa: E402

from ripplekv.engine.quantize import quantize_groups  # noqa: E402


def test_group_steps_are_each_groups_span_over_its_levels_with_a_short_last_group():
    x = np.array([[0.0, 3.0, 1.0, 6.0, 2.0], [5.0, 5.0, -1.0, 2.0, 2.0]], dtype=np.float32)
    want = np.array([[1.0, 1.0, 5 / 3, 5 / 3, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(group_steps(x, 2, 2), want, rtol=1e-7)  # groups (0,1), (2,3), (4)
    assert group_steps(x, 2, 4)[0, 0] == np.float32(3 / 15)


def test_agreement_counts_the_same_level_within_half_a_step_and_measures_the_worst_in_steps():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=generator)
    ours = quantize_groups(x, 2, torch.float32).numpy()
    steps = group_steps(x.numpy(), 8, 2)
    theirs = ours.copy()
    theirs[0, 0] = np.nextafter(theirs[0, 0], np.float32(np.inf))  # float rounding: same level, not bitwise equal
    theirs[1, 2] += steps[1, 2]  # one level up
    got = agreement(ours, theirs, steps)
    assert got == {"numbers": 48, "exact": 46, "same_level": 47, "max_steps": got["max_steps"]}
    assert abs(got["max_steps"] - 1) < 1e-5
    assert agreement(ours, ours, steps) == {"numbers": 48, "exact": 48, "same_level": 48, "max_steps": 0.0}


def test_a_constant_group_agrees_only_where_equal_and_tallies_merge():
    steps = np.zeros(4, dtype=np.float32)
    ours = np.full(4, 2.5, dtype=np.float32)
    theirs = ours.copy()
    theirs[3] = 2.5000002
    got = agreement(ours, theirs, steps)
    assert (got["exact"], got["same_level"], got["max_steps"]) == (3, 3, np.inf)
    total = merged([got, agreement(ours, ours, steps)])
    assert (total["numbers"], total["exact"], total["same_level"], total["max_steps"]) == (8, 7, 7, np.inf)
