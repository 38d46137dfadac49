"""Selection by score (methods.core.selection): the mask path keeps exactly the entries the stable sort keeps."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv.methods.core.selection import top_indices, top_mask, top_scored_mask

# few distinct values, so ties are the rule; the signed zeros and infinities rank as the sort ranks them
VALUES = st.sampled_from([0.0, -0.0, 1.0, 2.5, -3.0, float("inf"), float("-inf"), 1e-30])


def sorted_mask(scores: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top_indices(scores, count), True)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda heads: st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.lists(VALUES, min_size=n, max_size=n), min_size=heads, max_size=heads), st.integers(0, n + 2)))))
def test_the_mask_keeps_what_the_stable_sort_keeps(case):
    rows, count = case
    scores = torch.tensor(rows)
    assert torch.equal(top_mask(scores, count), sorted_mask(scores, count))


def test_nan_scores_take_the_sort():
    scores = torch.tensor([[1.0, float("nan"), 3.0, 3.0, 0.5]])
    assert torch.equal(top_mask(scores, 2), sorted_mask(scores, 2))
    assert top_mask(scores, 2)[0, 1]  # NaN ranks highest, as in torch.sort


def test_a_random_head_keeps_the_count_and_the_window():
    torch.manual_seed(0)
    scores = torch.randn(3, 500).round(decimals=1)  # rounded: many ties
    mask = top_scored_mask(scores, 532, 32, 100)
    assert mask.shape == (3, 532) and mask.sum(-1).tolist() == [100, 100, 100]
    assert mask[:, 500:].all()
    assert torch.equal(mask[:, :500], sorted_mask(scores, 68))
