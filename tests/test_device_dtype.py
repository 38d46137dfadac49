"""Device and dtype: bfloat16 on the CPU end to end, CUDA where it exists, and the model adapter's checks."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from ripplekv.cli.options import flag
from ripplekv.engine import adapter
from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import full_reference, greedy_decode, measure_fidelity
from ripplekv.engine.models import resolve_device_dtype
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.signals.query_statistics import QUERY_STATISTICS
from ripplekv.pipeline.profile import ProfileSettings, profile_prompt, split_prompt
from tests.conftest import tiny_llama

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
METHODS = ("snapkv", "pyramidkv", "streamingllm", "adakv")


def prompt(length=300, seed=1):
    return torch.randint(0, 101, (length,), generator=torch.Generator().manual_seed(seed))


def fidelity_run(model, ids):
    state = prefill(model, ids, capture_window=64)
    reference = full_reference(model, state, 20)
    variants = [make_method(name).compress(state, 48) for name in METHODS]
    tokens = greedy_decode(model, state, variants, 20)
    return reference.tokens, tokens, [f.kl for f in measure_fidelity(model, state, variants, reference)]


def test_bfloat16_follows_float32_within_stated_tolerances():
    """Stated tolerances: the same full-cache greedy answer; every variant's fidelity KL (along that answer)
    within 10% (+1e-4); profile KLs within 35%. (Greedy tokens of compressed variants may flip at near-ties of
    a random model's logits, so they are compared through KL, not token by token.)"""
    model32 = tiny_llama(vocab_size=101)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    ids = prompt()
    full32, tokens32, kl32 = fidelity_run(model32, ids)
    full16, tokens16, kl16 = fidelity_run(model16, ids)
    assert full16 == full32 and len(tokens16) == len(tokens32) == len(METHODS)
    assert np.allclose(kl16, kl32, rtol=0.10, atol=1e-4)
    calibration = split_prompt("s", ids.tolist(), 12)
    settings = ProfileSettings(seeds=1)
    profile32, profile16 = profile_prompt(model32, calibration, settings, 0), profile_prompt(model16, calibration, settings, 0)
    assert np.allclose(profile16, profile32, rtol=0.35)
    assert (profile16 > 0).all()


@pytest.mark.slow
def test_eval_in_bfloat16_runs_end_to_end_and_records_it(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--budget", "64", "--methods", "uniform,snapkv,adakv",
                           "--dtype", "bfloat16", "--out", str(out))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["device"] == "cpu"
    assert config["versions"]["torch"] == torch.__version__ and "attention" in config
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"full", "uniform", "adakv"}  # snapkv is uniform: computed once
    assert "note: snapkv is another name for uniform" in err


@pytest.mark.slow
def test_profile_records_device_and_dtype(tiny_model_dir, tmp_path, run_cli):
    code, _, err = run_cli("profile", "--model", str(tiny_model_dir), "--calib-samples", "1", "--seeds", "1",
                           "--target-tokens", "300", "--dtype", "bfloat16", "--out", str(tmp_path / "p"))
    assert code == 0, err
    meta = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["device"] == "cpu" and meta["versions"]["transformers"]


@pytest.mark.parametrize("device, dtype, message", [("gpu", "auto", "^device must be"), ("cpu", "fp8", "^dtype must be"),
                                                    ("cuda:x", "auto", "^device must be")])
def test_bad_device_or_dtype_is_one_clear_error(device, dtype, message):
    with pytest.raises(UserError, match=message):
        resolve_device_dtype(device, dtype)


def test_auto_picks_cpu_and_float32_without_a_gpu():
    if torch.cuda.is_available():
        assert resolve_device_dtype() == ("cuda", "bfloat16")
    else:
        assert resolve_device_dtype() == ("cpu", "float32")
        with pytest.raises(UserError, match="no CUDA device"):
            resolve_device_dtype("cuda", "auto")


@CUDA
def test_cuda_matches_the_cpu_in_float32():
    model = tiny_llama(vocab_size=101)
    ids = prompt()
    cpu_full, cpu_tokens, cpu_kl = fidelity_run(model, ids)
    gpu_full, gpu_tokens, gpu_kl = fidelity_run(copy.deepcopy(model).to("cuda"), ids)
    assert gpu_full == cpu_full and gpu_tokens == cpu_tokens
    assert np.allclose(gpu_kl, cpu_kl, rtol=1e-3, atol=1e-6)


@CUDA
def test_cuda_bfloat16_eval_runs(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit", "1",
                           "--target-tokens", "300", "--budget", "64", "--methods", "snapkv,streamingllm",
                           "--device", "cuda", "--out", str(out))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "cuda" and config["dtype"] == "bfloat16"


def test_rope_inverse_round_trips_at_every_position():
    model = tiny_llama(vocab_size=101)
    keys = torch.randn(2, 50, 16)
    positions = torch.arange(50)
    cos, sin = adapter.rope_at(model, positions, keys)
    rotated = adapter.apply_rope(keys, cos, sin)
    assert not torch.allclose(rotated, keys)
    assert torch.allclose(adapter.invert_rope(rotated, cos, sin), keys, atol=1e-5)
    # The prefill's keys are the model's rotated keys: un-rotating them gives position-free keys, and
    # a key rotated to p then un-rotated at p is itself.
    state = prefill(model, prompt(50), capture_window=16)
    plain = adapter.invert_rope(state.keys[0].float(), cos, sin)
    assert torch.allclose(adapter.apply_rope(plain, cos, sin), state.keys[0], atol=1e-5)


LONG_ROPE = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 1024, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("kind", sorted(LONG_ROPE))
def test_unrotated_keys_and_queries_are_the_models_own_under_long_context_rope(kind):
    """YaRN and longrope scale cos and sin by attention_scaling (!= 1): un-rotating must divide it out, so
    un-rotated keys are the model's pre-RoPE keys and the query statistics its pre-RoPE queries'."""

    model = tiny_llama(vocab_size=101, rope_parameters=LONG_ROPE[kind])
    scale = adapter.rope_scale(model)
    assert abs(scale - 1.0) > 0.05
    ids = prompt(60)
    state = prefill(model, ids, capture_window=16, requirements=Requirements(signals={QUERY_STATISTICS}))
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[None]))
        plain_keys = attention.k_proj(hidden).view(1, 60, -1, 16)[0].transpose(0, 1)  # [H_kv, n, d] before RoPE
        plain_queries = attention.q_proj(hidden).view(1, 60, -1, 16)[0].transpose(0, 1)
    cos, sin = adapter.rope_at(model, torch.arange(60), state.keys[0])
    assert torch.allclose(adapter.invert_rope(state.keys[0], cos, sin, scale), plain_keys, atol=1e-5)
    assert not torch.allclose(adapter.invert_rope(state.keys[0], cos, sin), plain_keys, atol=1e-3)  # the bug it fixes
    stats = state.signal(QUERY_STATISTICS)[0]
    assert torch.allclose(stats.total / stats.count, plain_queries.mean(1), atol=1e-5)
    assert torch.allclose(stats.first, plain_queries[:, : stats.first.shape[1]], atol=1e-5)


def test_sliding_window_models_refuse_prompts_beyond_their_window():
    mistral = MistralConfig(sliding_window=4096)
    adapter.check_length(mistral, 4000)  # within the window sliding and full attention agree
    with pytest.raises(UserError, match="sliding_window=4096.*max_length") as raised:
        adapter.check_length(mistral, 7500)
    assert "pass --max-length 3840 or less" in raised.value.phrased(flag)  # the CLI names its flag
    adapter.check_length(MistralConfig(sliding_window=None), 7500)
    adapter.check_length(LlamaConfig(max_position_embeddings=131072), 100_000)


def test_prompt_and_answer_beyond_the_models_positions_are_refused_with_the_max_length_that_fits():
    config = LlamaConfig(max_position_embeddings=2048)
    adapter.check_length(config, 2000, 48)  # exactly fits
    with pytest.raises(UserError, match=r"2049 tokens \(2001 \+ 48\).*max_position_embeddings=2048.*max_length 2000 or less"):
        adapter.check_length(config, 2001, 48)


def test_logit_soft_capping_is_refused():
    config = LlamaConfig()
    config.final_logit_softcapping = 30.0
    with pytest.raises(UserError, match="soft-capping"):
        adapter.check_supported(config)


def test_cache_crops_decoded_tokens_but_never_prompt_entries():
    model = tiny_llama(vocab_size=101)
    state = prefill(model, prompt(80), capture_window=16)
    cache = build_cache(state, [make_method("snapkv:window=8").compress(state, 20)] * 2)
    greedy_decode(model, state, None, 1)  # no-op warm path
    from ripplekv.engine.decode import forward_tokens

    forward_tokens(model, cache, torch.tensor([[1, 2, 3], [4, 5, 6]]), state.length)
    layer = cache.layers[0]
    assert layer.decoded_length() == 3 and cache.get_seq_length() == 83
    cache.crop(-1)
    assert layer.decoded_length() == 2 and cache.get_seq_length() == 82
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(layer.keys[0], layer.keys[1])
    with pytest.raises(ValueError, match="only crop decoded tokens"):
        cache.crop(-5)
