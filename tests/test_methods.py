"""What each method keeps: StreamingLLM's sinks and recent window, SnapKV's top scores plus the window."""

import pytest
import torch

from ripplekv.errors import UserError
from ripplekv.methods import make_method, method_names
from ripplekv.methods.snapkv import window_scores
from tests.test_budgets import fake_state


def test_streamingllm_keeps_first_four_and_last_rest():
    state = fake_state(3, 200)
    masks = make_method("streamingllm").select(state, 20)
    expected = torch.zeros(200, dtype=torch.bool)
    expected[:4] = True
    expected[-16:] = True
    assert (masks == expected).all()


def test_snapkv_keeps_window_and_top_scored_prefix():
    state = fake_state(2, 300)
    method = make_method("snapkv", window=16, kernel=5)
    masks = method.select(state, 48)
    for layer in range(2):
        scores = window_scores(state, layer, 16, 5, "max")
        for head in range(state.num_kv_heads):
            kept = masks[layer, head]
            assert kept[-16:].all()
            prefix_kept = kept[:-16].nonzero().flatten()
            assert len(prefix_kept) == 32
            # Every kept prefix entry scores at least as high as every dropped one.
            dropped = (~kept[:-16]).nonzero().flatten()
            assert scores[head, prefix_kept].min() >= scores[head, dropped].max()


def test_snapkv_scores_match_a_direct_attention_computation():
    state = fake_state(1, 120, kv_heads=2, query_heads=4)
    scores = window_scores(state, 0, 8, 1, "none")
    q = state.window_queries[0][:, -8:]
    k = torch.repeat_interleave(state.keys[0], 2, dim=0)
    logits = q @ k.transpose(-1, -2) * state.scaling
    positions = torch.arange(120)
    causal = positions[None, :] <= (112 + torch.arange(8))[:, None]
    attn = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).sum(1)  # [H_q, n]
    expected = attn.view(2, 2, 120).mean(1)[:, :112]
    assert torch.allclose(scores, expected, atol=1e-6)


def test_kept_positions_sorted_and_unique_after_gather():
    from ripplekv.cache import gather_selection

    state = fake_state(1, 100)
    masks = torch.stack([make_method(n, multipliers=(1.0,)).select(state, 30)[0] for n in ("snapkv", "random")])
    keys, _, bias = gather_selection(state.keys[0], state.values[0], masks)
    assert bias is None and keys.shape == (2, 2, 30, 8)
    for v in range(2):
        for h in range(2):
            positions = masks[v, h].nonzero().flatten()
            assert torch.equal(keys[v, h], state.keys[0][h, positions])
            assert (positions[1:] > positions[:-1]).all()


def test_registry_lists_methods_and_rejects_unknown():
    assert {"full", "snapkv", "streamingllm", "pyramidkv", "ripplekv", "random"} <= set(method_names())
    with pytest.raises(UserError, match="known methods: full"):
        make_method("h2o")


def test_ripplekv_needs_an_allocation_and_a_matching_layer_count(tmp_path):
    with pytest.raises(UserError, match="ripplekv profile"):
        make_method("ripplekv")
    alloc = tmp_path / "alloc.csv"
    alloc.write_text("layer,multiplier\n0,1.5\n1,0.5\n")
    method = make_method("ripplekv", allocation=str(alloc))
    assert method.layer_budgets(2, 100, 1000) == [150, 50]
    with pytest.raises(UserError, match="2 layers but the model has 3"):
        method.layer_budgets(3, 100, 1000)


@pytest.mark.parametrize(
    "text, message",
    [
        ("layer,weight\n0,1\n", "lacks column"),
        ("layer,multiplier\n0,1\n0,2\n", "exactly once"),
        ("layer,multiplier\n0,1\n1,0\n", "non-positive"),
        ("layer,multiplier\n0,1\n1,abc\n", "non-positive"),
    ],
)
def test_malformed_allocation_is_one_clear_error(tmp_path, text, message):
    alloc = tmp_path / "alloc.csv"
    alloc.write_text(text)
    with pytest.raises(UserError, match=message):
        make_method("ripplekv", allocation=str(alloc))
