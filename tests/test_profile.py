"""RippleKV profiling: batched equals one layer at a time, zero perturbation is zero KL, seeds reproduce."""

import json

import numpy as np
import pytest
import torch

from ripplekv.errors import UserError
from ripplekv.pipeline.profile import (
    Profile,
    ProfileSettings,
    noise_delta,
    profile_prompt,
    split_prompt,
    write_profile,
)
from tests.conftest import load_script, tiny_llama, tiny_qwen2

profile_prompt_one_layer_at_a_time = load_script("naive_profile").profile_prompt_one_layer_at_a_time


def calibration(length=160, probe=12, seed=3):
    ids = torch.randint(0, 101, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return split_prompt(f"s{seed}", ids, probe)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("signal, pruner", [("noise", "h2o"), ("evict", "h2o"), ("evict", "snapkv")])
def test_batched_profile_equals_one_layer_at_a_time(build, signal, pruner):
    model = build()
    prompt = calibration()
    settings = ProfileSettings(eta=1.0, seeds=2, signal=signal, probe_tokens=12, evict_budget=24, batch_size=3,
                               evict_method=pruner, measure="kl")
    batched = profile_prompt(model, prompt, settings, 0)
    naive = profile_prompt_one_layer_at_a_time(model, prompt, settings, 0)
    assert batched.shape == naive.shape == ((2 if signal == "noise" else 1), 4)
    assert (batched > 0).all()
    assert np.allclose(batched, naive, atol=1e-5, rtol=1e-3)


def test_zero_perturbation_gives_zero_kl():
    result = profile_prompt(tiny_llama(), calibration(), ProfileSettings(eta=0.0, seeds=1, probe_tokens=12), 0)
    assert np.abs(result).max() < 1e-7


def test_profile_is_deterministic_for_a_seed_and_changes_with_it():
    model, prompt = tiny_llama(), calibration()
    settings = ProfileSettings(eta=0.5, seeds=2, probe_tokens=12)
    first, again = profile_prompt(model, prompt, settings, 0), profile_prompt(model, prompt, settings, 0)
    assert np.array_equal(first, again)
    assert not np.allclose(first[0], first[1])  # two seeds draw different noise


def test_noise_is_norm_adaptive():
    values = torch.randn(3, 500, 64) * torch.linspace(0.1, 10, 500)[None, :, None]
    delta = noise_delta(values, 0.5, torch.Generator().manual_seed(0))
    ratio = delta.norm(dim=-1) / values.norm(dim=-1)
    assert float(ratio.mean()) == pytest.approx(0.5, rel=0.05)  # same relative size for small and large vectors
    assert float(ratio[:, :250].mean()) == pytest.approx(float(ratio[:, 250:].mean()), rel=0.1)


def test_profile_outputs_and_split_half(tmp_path):
    per_seed = np.random.default_rng(0).random((6, 2, 5)) + np.arange(5)[None, None, :]
    prompts = [calibration(seed=s) for s in range(6)]
    profile = Profile([p.sample_id for p in prompts], per_seed.mean(1), per_seed, ProfileSettings(seeds=2), "tiny")
    meta = write_profile(profile, prompts, tmp_path)
    table = __import__("pandas").read_csv(tmp_path / "sensitivity.csv")
    assert list(table.columns) == ["layer", "kl_mean", "kl_std", "kl_median", "n_samples"]
    assert np.allclose(table["kl_mean"], per_seed.mean(1).mean(0))
    assert meta["split_half_spearman"] == pytest.approx(1.0)
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["calibration_ids"] == [p.sample_id for p in prompts] and len(saved["calibration_hash"]) == 16
    assert (tmp_path / "sensitivity.png").stat().st_size > 1000
    assert len(__import__("pandas").read_csv(tmp_path / "per_sample.csv")) == 6 * 2 * 5


def test_bad_settings_are_user_errors():
    with pytest.raises(UserError, match="unknown signal"):
        ProfileSettings(signal="prune").check()
    with pytest.raises(UserError, match="compressing method"):
        ProfileSettings(signal="evict", evict_method="full").check()
    with pytest.raises(UserError, match="unknown method"):
        ProfileSettings(signal="evict", evict_method="nope").check()
    with pytest.raises(UserError, match="too short"):
        split_prompt("x", list(range(10)), 12)
