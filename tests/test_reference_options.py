"""The options that reproduce a reference's own choices for make check-references, each against that choice written
out by hand on a tiny model (the reference venv itself is not part of the tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.recorders import SampleContext
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.allocators import kvpress_pyramid
from ripplekv.methods.kvzip import reconstruction_scores, template_opening
from tests.conftest import tiny_llama

N, LAYERS, KV = 400, 4, 2


@pytest.fixture(scope="module")
def state():
    specs = ["snapkv", "expected-attention:window=0", "keydiff:window=0", "criticalkv"]
    needs = Requirements.of_all(make_method(s) for s in specs)
    return prefill_for(tiny_llama(), torch.randint(3, 101, (N,), generator=torch.Generator().manual_seed(5)), needs)


def test_kvpress_pyramid_is_its_arithmetic_sequence_and_uniform_below_beta_windows():
    budgets = kvpress_pyramid(30, 768, 3500, 32, 20.0)
    assert budgets[0] == round(2 * 768 - 768 / 20) and budgets[-1] == round(768 / 20)
    assert abs(sum(budgets) - 30 * 768) <= 15  # each layer rounded alone: the total drifts
    assert kvpress_pyramid(30, 512, 3500, 32, 20.0) == [512] * 30  # its last layer would hold 25.6 < the window
    short = kvpress_pyramid(30, 700, 809, 32, 20.0)  # capped at n - window: the sequence is flattened around B
    assert short[0] == 777 and short[-1] == 2 * 700 - 777
    method = make_method("pyramidkv:schedule=kvpress")
    assert method.layer_budgets(30, 768, 3500) == budgets and method.layer_budgets(30, 900, 800) == [800] * 30
    with pytest.raises(UserError, match="schedule must be one of"):
        make_method("pyramidkv:schedule=factory")


def test_window_zero_ranks_every_entry_as_kvpress_does(state):
    for spec in ("expected-attention:window=0", "keydiff:window=0"):
        method = make_method(spec)
        kept = method.select(state, 40)
        for layer in range(LAYERS):
            scores = method.scorer.scores(state, layer)
            assert scores.shape[1] == N  # no window cut off
            top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :40]
            assert torch.equal(kept[layer], torch.zeros_like(kept[layer]).scatter_(1, top, True))
    assert not make_method("keydiff:window=0").select(state, 40)[:, :, -8:].all()  # the last tokens compete too


def test_adakv_kvpress_rule_is_its_safeguard_then_one_top_k_across_heads(state):
    """kvpress's AdaKVPress, written out: the window scores above every prefix entry, each head's top
    int(alpha n_kept) are forced, then the layer keeps its top H x n_kept scores; at B = 200 the safeguard (40)
    reaches past the window (32)."""
    method, window, budget = make_method("adakv:rule=kvpress"), 32, 200
    counts = method.budgets(state, budget)
    for layer in range(LAYERS):
        prefix = method.scorer.scores(state, layer)
        scores = torch.cat([prefix, prefix.new_full((KV, window), float(prefix.max()) + 1)], dim=1)
        safe = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : int(0.2 * budget)]
        guarded = scores.scatter(1, safe, float("inf"))
        chosen = torch.sort(guarded.reshape(-1), descending=True, stable=True).indices[: KV * budget]
        assert np.bincount((chosen // N).numpy(), minlength=KV).tolist() == counts[layer].tolist()
    assert counts.sum() == LAYERS * KV * budget and counts.min() >= int(0.2 * budget)
    assert not np.array_equal(counts, make_method("adakv").budgets(state, budget))  # FFY0's rule differs


def test_criticalkv_safeguard_widens_the_first_stage_to_alpha_of_the_layer_budget(state):
    plain, guarded = make_method("criticalkv"), make_method("criticalkv:safeguard=0.5")
    counts = torch.tensor([150, 50])  # the layer's mean is 100: safeguard 50 > int(0.5 x 50) = 25 in head 1
    scorer = guarded.scorer
    kept = scorer.keep(state, 0, counts)
    base = scorer.scores(state, 0)
    first = torch.sort(base[1], descending=True, stable=True).indices[: 50 - 32]
    assert kept[1, first].all() and kept.sum(-1).tolist() == [150, 50]
    assert not torch.equal(kept, plain.scorer.keep(state, 0, counts))


def test_global_entry_granularity_is_one_top_k_over_every_layer_and_head(state):
    spec = "snapkv:allocator=global:granularity=entry"
    counts = make_method(spec).budgets(state, 48)
    scorer = make_method(spec).scorer
    prefix = torch.stack([torch.sort(scorer.scores(state, layer), dim=-1, descending=True).values for layer in range(LAYERS)])
    chosen = torch.sort(prefix.reshape(-1), descending=True, stable=True).indices[: LAYERS * KV * (48 - 32)]
    won = np.bincount((chosen // prefix.shape[-1]).numpy(), minlength=LAYERS * KV).reshape(LAYERS, KV)
    assert counts.tolist() == (won + 32).tolist() and counts.sum() == LAYERS * KV * 48
    assert any(row.sum() % KV for row in counts)  # a layer's total need not be a multiple of H_kv
    with pytest.raises(UserError, match="granularity must be one of"):
        make_method("kvzip:granularity=head")


def test_kvzip_skip_template_starts_the_reconstruction_after_the_chat_opening(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer), seed=2)
    opening = template_opening(tokenizer)
    body = torch.randint(200, 5000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    text = tokenizer.apply_chat_template([{"role": "user", "content": tokenizer.decode(body)}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = prefill_for(model, ids, Requirements(tokenizer=True), context=SampleContext(tokenizer=tokenizer))
    assert 4 < opening < 40 and ids[:opening] == tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False).split("x")[0], add_special_tokens=False)
    skipped, whole = reconstruction_scores(state, 4, 2048, 1), reconstruction_scores(state, 4, 2048, 0)
    assert (skipped[..., 4:opening] == 0).all() and (whole[..., 4:opening] > 0).all()
    assert (skipped[..., :4] == 1).all() and (skipped[..., opening:] > 0).all()
    chunked = reconstruction_scores(state, 4, 64, 1)  # later chunks repeat the previous one's last 8 tokens first
    assert (chunked[..., 4:opening] == 0).all() and not torch.allclose(chunked, skipped)
