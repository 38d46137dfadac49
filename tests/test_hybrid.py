"""Hybrid attention (sliding-window layers beside global ones: Gemma 2/3, Qwen2 with `layer_types`) against the
model itself, and the budget rule for layers that hold less than the prompt.

A sliding layer of window W holds the last W - 1 prompt entries (the model's own cache) and lets one more go
at every decoded token; the full cache must give the model's own tokens and log-probs past the window, every
method must keep exactly its budget as fitted to what each layer holds, and no method may keep what a sliding
layer cannot (docs/methods.md "Hybrid attention")."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from ripplekv.engine import entries
from ripplekv.engine.adapter import has_sliding_layers, layer_capacities, layer_windows, sliding_window
from ripplekv.engine.cache import CompressedLayer, build_cache, compressed_attention
from ripplekv.engine.decode import greedy_decode, teacher_forced_logprobs
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.engine.recorders import SampleContext
from ripplekv.errors import UserError
from ripplekv.methods import make_method, method_names
from ripplekv.methods.core.budgets import fit_to_capacities, integer_budgets
from tests.conftest import HYBRID_BUILDERS, HYBRID_WINDOW, StubTokenizer, every_method, satisfy, tiny_gemma3
from tests.test_budgets import check_bytes

LENGTH = 70  # prompt tokens: more than a sliding layer holds (HYBRID_WINDOW - 1)
STEPS = 24  # decoded tokens: the window slides past every prompt entry a sliding layer held


def prompt(length=LENGTH, seed=1):
    return torch.randint(0, 101, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=sorted(HYBRID_BUILDERS))
def hybrid_model(request):
    return HYBRID_BUILDERS[request.param]()


def test_windows_and_capacities_follow_the_config():
    gemma = tiny_gemma3().config
    assert layer_windows(gemma) == [HYBRID_WINDOW] * 5 + [None] and has_sliding_layers(gemma)
    assert sliding_window(gemma) is None  # a global layer reads the whole prompt: no length is refused for the window
    assert layer_capacities(LENGTH, layer_windows(gemma)) == [HYBRID_WINDOW - 1] * 5 + [LENGTH]
    assert layer_capacities(10, layer_windows(gemma)) == [10] * 6  # a short prompt fits every layer whole


def test_full_cache_is_the_models_own_output_past_the_window(hybrid_model):
    """Prefill logits, greedy tokens (decoded well past the window) and teacher-forced log-probs equal the stock
    model's (`generate` with its own sliding cache, and a plain forward over prompt + answer)."""
    ids = prompt()
    stock = copy.deepcopy(hybrid_model)
    expected = stock.generate(ids[None], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)[0, LENGTH:].tolist()
    state = prefill(hybrid_model, ids, capture_window=16)
    assert state.hybrid and min(state.capacities) == HYBRID_WINDOW - 1
    assert torch.allclose(state.last_logits, stock(ids[None]).logits[0, -1], atol=1e-5)
    assert greedy_decode(hybrid_model, state, None, STEPS)[0] == expected
    logits = stock(torch.cat([ids, torch.tensor(expected[:-1])])[None]).logits[0, LENGTH - 1 :]
    ours = teacher_forced_logprobs(hybrid_model, state, None, expected)[0]
    assert torch.allclose(ours, torch.log_softmax(logits, -1), atol=1e-5)
    # A budget above every capacity keeps each layer as the model holds it: the prefill's own entries.
    variants = [make_method(name).compress(state, 500) for name in ("snapkv", "pyramidkv", "streamingllm")]
    assert all(layer is state.full_entries(i) for v in variants for i, layer in enumerate(v))
    assert greedy_decode(hybrid_model, state, variants, STEPS) == [expected] * 3


def test_compressed_global_layers_decode_as_the_stock_model_holding_the_kept_entries(hybrid_model):
    """Reference: the stock model with its own cache, whose global layers hold only SnapKV's kept K/V and whose
    sliding layers hold (and evict) their window as the model does."""
    ids = prompt()
    state = prefill(hybrid_model, ids, capture_window=16)
    method = make_method("snapkv", window=8)
    mask = method.select(state, 24)
    ours_entries = [state.full_entries(i) if state.window(i) is not None
                    else entries.gather(state.keys[i], state.values[i], mask[i]) for i in range(state.num_layers)]
    ours = greedy_decode(hybrid_model, state, [ours_entries], STEPS)[0]
    stock = copy.deepcopy(hybrid_model)
    stock.set_attn_implementation("eager")  # the model's own attention (Gemma 2 offers no sdpa)
    cache = DynamicCache(config=stock.config)
    for layer in range(state.num_layers):
        keys, values = state.keys[layer], state.values[layer]
        if state.window(layer) is None:
            kept = [mask[layer, h].nonzero().flatten() for h in range(state.num_kv_heads)]
            keys = torch.stack([keys[h, k] for h, k in enumerate(kept)])
            values = torch.stack([values[h, k] for h, k in enumerate(kept)])
        cache.update(keys[None], values[None], layer)
    tokens = [int(state.last_logits.argmax())]
    for step in range(1, STEPS):
        out = stock(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[LENGTH + step - 1]]),
                    cache_position=torch.tensor([LENGTH + step - 1]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    assert ours == tokens


def test_a_sliding_layer_sees_only_entries_inside_its_window():
    """Our attention on a sliding layer against a direct softmax: a query at position p sees kept prompt entries
    and decoded tokens from positions after p - W only, whichever entries a method kept."""
    gen = torch.Generator().manual_seed(0)
    heads, kept, dim, window, original, decoded = 2, 6, 8, 5, 20, 4
    positions = torch.stack([torch.tensor([12, 15, 16, 17, 18, 19]), torch.tensor([3, 14, 16, 18, 19, -1])])
    keys, values = torch.randn(heads, kept, dim, generator=gen), torch.randn(heads, kept, dim, generator=gen)
    bias = torch.zeros(heads, kept).masked_fill(positions < 0, float("-inf"))
    layer = CompressedLayer(keys[None], values[None], bias[None], original).slide(window, positions[None])
    new_keys, new_values = torch.randn(1, heads, decoded, dim, generator=gen), torch.randn(1, heads, decoded, dim, generator=gen)
    layer.update(new_keys, new_values)
    query = torch.randn(1, heads, 2, dim, generator=gen)  # the last two decoded tokens, at positions 22 and 23
    out = compressed_attention(query, layer, new_keys, new_values, 0.5)[0]  # [P, H, d]
    for p, at in enumerate((original + decoded - 2, original + decoded - 1)):
        for h in range(heads):
            all_keys = torch.cat([keys[h], new_keys[0, h]])
            all_values = torch.cat([values[h], new_values[0, h]])
            where = torch.cat([positions[h], torch.arange(original, original + decoded)])
            seen = (where > at - window) & (where <= at) & (where >= 0)
            weights = torch.softmax((all_keys[seen] @ query[0, h, p]) * 0.5, -1)
            assert torch.allclose(out[p, h], weights @ all_values[seen], atol=1e-5)


def test_batched_hybrid_variants_decode_as_one_at_a_time(hybrid_model):
    state = prefill(hybrid_model, prompt(), capture_window=16)
    variants = [make_method(name, **opts).compress(state, 10)
                for name, opts in (("snapkv", {"window": 4}), ("pyramidkv", {"window": 4}), ("streamingllm", {}))]
    alone = [greedy_decode(hybrid_model, state, [v], STEPS)[0] for v in variants]
    assert greedy_decode(hybrid_model, state, variants, STEPS) == alone


@pytest.fixture(scope="module")
def hybrid_state(tmp_path_factory):
    """One prefill of a tiny Gemma 3 recording what every registered method needs (their inputs, such as an
    LU-KV curve, stay on disk while the module's tests read them)."""
    model = tiny_gemma3()
    folder = tmp_path_factory.mktemp("hybrid-methods")
    methods = every_method(model.config.num_hidden_layers, folder, kv_heads=model.config.num_key_value_heads)
    needs = Requirements.of_all(methods.values())
    state = prefill(model, prompt(90), requirements=needs, context=SampleContext(StubTokenizer(), (3,)))
    return satisfy(state), methods


@pytest.mark.parametrize("name", method_names())
def test_every_method_keeps_exactly_its_budget_on_a_hybrid_model(hybrid_state, name):
    """Every registered method: counts built equal the allocated [L, H] matrix, no head over its layer's capacity,
    nothing kept from before a sliding layer's window, and min(L x H x B, H x sum of capacities) entries in all."""
    state, methods = hybrid_state
    method = methods[name]
    layers, heads, caps = state.num_layers, state.num_kv_heads, state.capacities
    if not getattr(method, "sliding_layers", True):
        with pytest.raises(UserError, match="sliding-window layers"):
            method.compress(state, 24)
        return
    for budget in (4, 12, 24, 60, 200):
        if getattr(method, "quantizer", None) is not None:  # budget B is bytes here (tests/test_memory_axis.py)
            check_bytes(method, state, budget)
            continue
        counts = method.budgets(state, budget)
        built = method.compress(state, budget)
        assert [layer.counts.tolist() for layer in built] == counts.tolist(), (name, budget)
        expected = heads * sum(caps) if method.is_full else min(layers * heads * budget, heads * sum(caps))
        assert int(counts.sum()) == expected, (name, budget)
        for layer, entry in enumerate(built):
            assert int(entry.counts.max()) <= caps[layer]
            kept = entry.positions[entry.positions >= 0]
            assert int(kept.min()) >= state.held_from(layer), (name, budget, layer)
        if not method.prompt_dependent:
            assert [row[0] for row in counts.tolist()] == method.layer_budgets(layers, budget, caps)


def test_a_layer_that_cannot_hold_its_share_passes_the_rest_on():
    """B per layer, capped at a sliding layer's capacity, the remainder moved to the layers that can hold it,
    in proportion to their shares; with too little room everywhere, every layer keeps all it holds."""
    assert integer_budgets([1, 1, 1, 1], 100, [50, 400, 50, 400]) == [50, 150, 50, 150]
    assert integer_budgets([1, 3, 1, 1], 100, [50, 400, 50, 400]) == [50, 225, 50, 75]
    assert integer_budgets([1, 1], 300, [100, 400]) == [100, 400]
    pyramid = make_method("pyramidkv")
    assert pyramid.layer_budgets(4, 128, [511, 511, 511, 2000]) == pyramid.layer_budgets(4, 128, 2000)
    capped = pyramid.layer_budgets(4, 128, [100, 100, 100, 2000])
    assert capped[:3] == [100, 100, 100] and sum(capped) == 4 * 128


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 50.0, allow_nan=False), min_size=1, max_size=12),
    budget=st.integers(1, 300),
    caps=st.lists(st.integers(1, 600), min_size=12, max_size=12),
    floor=st.integers(1, 40),
)
def test_capped_budgets_are_exact_and_bounded(weights, budget, caps, floor):
    caps = caps[: len(weights)]
    counts = integer_budgets(weights, budget, caps, floor)
    assert sum(counts) == min(len(weights) * budget, sum(caps))
    assert all(min(floor, budget, cap) <= c <= cap for c, cap in zip(counts, caps)) or counts == caps


@settings(max_examples=200, deadline=None)
@given(data=st.data(), layers=st.integers(1, 6), heads=st.integers(1, 4))
def test_fitting_a_matrix_keeps_its_total_and_each_head_within_its_layer(data, layers, heads):
    counts = np.array(data.draw(st.lists(st.lists(st.integers(0, 300), min_size=heads, max_size=heads),
                                         min_size=layers, max_size=layers)), dtype=np.int64)
    caps = data.draw(st.lists(st.integers(1, 300), min_size=layers, max_size=layers))
    fitted = fit_to_capacities(counts, caps)
    assert int(fitted.sum()) == min(int(counts.sum()), heads * sum(caps))
    assert (fitted <= np.asarray(caps)[:, None]).all() and (fitted >= 0).all()
    if (counts <= np.asarray(caps)[:, None]).all():
        assert (fitted == counts).all()


def test_the_compress_api_generates_on_a_hybrid_model():
    """`ripplekv.compress` hands `model.generate` a cache of exactly the fitted budget; with room for everything,
    generate's answer is the model's own."""
    from ripplekv.api import compress

    model, ids = HYBRID_BUILDERS["gemma3"](), prompt()
    expected = copy.deepcopy(model).generate(ids[None], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    cache = compress(model, None, ids, method="snapkv", budget=500)
    out = model.generate(cache.input_ids, past_key_values=cache, max_new_tokens=STEPS - 1, min_new_tokens=STEPS - 1,
                         do_sample=False)
    assert out[0, LENGTH:].tolist() == expected[0, LENGTH:].tolist()
    small = compress(model, None, ids, method="pyramidkv", budget=12)
    caps = layer_capacities(LENGTH, layer_windows(model.config))
    assert small.kept_entries == model.config.num_key_value_heads * min(6 * 12, sum(caps))
    assert model.generate(small.input_ids, past_key_values=small, max_new_tokens=4, do_sample=False).shape[1] == LENGTH + 5


def test_build_cache_stacks_sliding_positions_with_padding():
    state = prefill(tiny_gemma3(), prompt(), capture_window=16)
    variants = [make_method("snapkv", window=4).compress(state, budget) for budget in (6, 10)]
    cache = build_cache(state, variants)
    for index, layer in enumerate(cache.layers):
        if state.window(index) is None:
            assert layer.window is None and layer.prompt_positions is None
            continue
        assert layer.window == HYBRID_WINDOW and layer.prompt_positions.shape == layer.prompt_bias.shape
        assert (layer.prompt_positions[0, :, 6:] == -1).all()
        assert (layer.prompt_positions[1] >= state.held_from(index)).all()


@pytest.mark.parametrize("signal", ["noise", "evict"])
def test_the_profile_on_a_hybrid_model_equals_one_layer_at_a_time(signal):
    """RippleKV's profile (noise) and DepthKV's (evict) through the shared probe equal a fresh prefill per layer
    (noise: on the stock model's own cache, whose sliding layers hold only their window)."""
    from ripplekv.pipeline.profile import ProfileSettings, profile_prompt
    from tests.conftest import load_script
    from tests.test_profile import calibration

    profile_prompt_one_layer_at_a_time = load_script("naive_profile").profile_prompt_one_layer_at_a_time

    model, sample = tiny_gemma3(), calibration()
    settings = ProfileSettings(eta=1.0, seeds=1, signal=signal, probe_tokens=12, evict_budget=8, batch_size=4,
                               evict_method="snapkv", measure="kl")
    batched = profile_prompt(model, sample, settings, 0)
    assert (batched > 0).all()  # every layer, sliding ones included, is changed by its perturbation
    assert np.allclose(batched, profile_prompt_one_layer_at_a_time(model, sample, settings, 0), atol=1e-5, rtol=1e-3)


def test_route_preferences_on_a_hybrid_model_equal_a_prefill_per_trial():
    from ripplekv.pipeline.route import RouteSettings, candidate_methods, preference_prompt
    from tests.conftest import load_script
    from tests.test_route import CANDIDATES, random_prompt

    preferences_one_trial_at_a_time = load_script("naive_route").preferences_one_trial_at_a_time

    model, sample = tiny_gemma3(), random_prompt()
    settings = RouteSettings(methods=CANDIDATES, budget=8, probe_tokens=12, batch_size=5)
    batched = preference_prompt(model, sample, candidate_methods(CANDIDATES), settings)
    naive = preferences_one_trial_at_a_time(model, sample, candidate_methods(CANDIDATES), 8, 12)
    assert batched.shape == (6, 3) and (batched > 0).all()
    assert np.allclose(batched, naive, atol=1e-5, rtol=1e-3)


def test_the_second_model_is_named_and_a_missing_install_says_how_to_get_it(monkeypatch):
    import importlib.util

    from ripplekv.engine import packaged
    from ripplekv.engine.models import resolve_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == packaged.GEMMA3_PACKAGE else real(name, *a))
    with pytest.raises(UserError, match=r"model gemma3-270m is not installed; run `make install`"):
        resolve_model("gemma3-270m")


def test_a_method_without_sliding_layers_runs_where_every_prompt_fits_the_window():
    """GraceKV cannot keep a sliding layer's window apart yet: it is refused only where some prompt is longer
    than a sliding layer holds (window - 1 tokens), not on every model with sliding-window layers."""
    import ripplekv
    from ripplekv.pipeline.samples import check_sliding_layers

    model = tiny_gemma3()
    methods = {"gracekv": make_method("gracekv")}
    held = HYBRID_WINDOW - 1
    check_sliding_layers(model.config, methods, longest=lambda: held)  # every layer holds the whole prompt
    for longest in (None, lambda: held + 1):
        with pytest.raises(UserError, match="gracekv cannot run on a model with sliding-window layers"):
            check_sliding_layers(model.config, methods, longest=longest)
    cache = ripplekv.compress(model, None, list(range(5, 5 + held)), method="gracekv", budget=4)
    assert cache.kept_entries == model.config.num_hidden_layers * model.config.num_key_value_heads * 4


@pytest.mark.parametrize("window, runs", [(2048, True), (48, False)])
def test_eval_runs_gracekv_on_a_hybrid_model_whose_window_holds_every_prompt(window, runs, tokenizer, tmp_path,
                                                                              run_cli):
    model = tiny_gemma3(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, sliding_window=window)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "eval"
    code, _, err = run_cli("eval", "--model", tmp_path / "model", "--suite", "offline", "--tasks", "niah", "--limit", 1,
                           "--target-tokens", 256, "--budget", 32, "--methods", "gracekv", "--out", out)
    if runs:
        assert code == 0 and (out / "predictions.jsonl").is_file(), err
    else:
        assert code == 2 and "is longer than a sliding layer holds (47)" in err and not out.exists(), err


def test_budgets_prints_what_each_layer_of_a_hybrid_model_keeps_in_eval(tokenizer, tmp_path, run_cli):
    """`ripplekv budgets` on a model with sliding-window layers shows what eval keeps (a sliding layer no more
    than its window holds), not budgets those layers cannot hold."""
    model = tiny_gemma3(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    length, budget = 200, 32
    code, out, err = run_cli("budgets", "--model", tmp_path / "model", "--methods", "snapkv,pyramidkv", "--budget",
                             budget, "--prompt-len", length, "--format", "csv")
    assert code == 0 and "sliding-window layers hold at most 15 of the 200 prompt tokens" in err, err
    printed = {}
    for line in out.strip().splitlines()[1:]:
        name, layer, count = line.split(",")
        printed.setdefault(name, []).append(int(count))
    state = prefill(model, torch.randint(0, len(tokenizer), (length,), generator=torch.Generator().manual_seed(0)))
    for name in ("snapkv", "pyramidkv"):
        kept = make_method(name).budgets(state, budget)  # what eval keeps per layer and KV head
        assert printed[name] == kept[:, 0].tolist(), name
        assert max(printed[name][layer] for layer, cap in enumerate(state.capacities) if cap < length) <= HYBRID_WINDOW - 1
