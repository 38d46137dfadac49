"""DepthKV's signals: the task drop against a hand computation (one layer pruned by a real shorter cache,
one variant at a time), and the InfoNCE against a plain loop over prompts."""

import math

import numpy as np
import pytest
import torch

from ripplekv.engine import entries
from ripplekv.engine.decode import greedy_decode, stop_tokens
from ripplekv.engine.prefill import prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.metrics.scoring import score_sample
from ripplekv.pipeline.profile import Profile, ProfileSettings, profile_unit
from ripplekv.pipeline.representation import anchor_losses, mutual_information_bound, pooled_layers, view_ids
from ripplekv.pipeline.taskdrop import kept_count, task_drop
from ripplekv.tasks.calibration import split_prompt
from ripplekv.tasks.registry import task_named
from tests.conftest import tiny_llama, tiny_qwen2


class WordTokenizer:
    """Token t reads as the word `wt`: enough for the task metrics to score a tiny model's answer."""

    eos_token_id = None

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(f"w{int(t)}" for t in tokens)


def sample(seed=0, length=120, task="squad"):
    ids = torch.randint(0, 101, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompt = split_prompt(f"s{seed}", ids, 8)
    prompt.task, prompt.answers = task, []
    return prompt


def hand_drops(model, tokenizer, prompt, pruner, ratio):
    """Prune layer l by gathering its kept entries into a shorter cache, decode each variant alone, score it."""
    task = task_named(prompt.task)
    state = prefill_for(model, prompt.context + prompt.probe, pruner.requirements(), reserve=task.max_new_tokens)
    keep = pruner.select(state, kept_count(state.length, ratio))
    stops = stop_tokens(model, tokenizer, task.stop_at_newline)

    def score(variant):
        tokens = greedy_decode(model, state, variant, task.max_new_tokens, stops, num_variants=1)[0]
        return score_sample(task, tokenizer.decode(tokens), prompt.answers)

    full = score(None)
    drops = []
    for layer in range(state.num_layers):
        variant = [state.full_entries(i) for i in range(state.num_layers)]
        variant[layer] = entries.gather(state.keys[layer], state.values[layer], keep[layer])
        assert int(variant[layer].counts[0]) == kept_count(state.length, ratio)
        drops.append(full - score([variant]))
    return full, np.array(drops)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_task_drop_equals_a_hand_computation(build):
    model, tokenizer = build(), WordTokenizer()
    pruner = make_method("h2o")
    prompt = sample(seed=1, length=200)
    # The gold answer is the full cache's own answer: it scores 1, and a layer's drop is 1 - F1 with it.
    task = task_named(prompt.task)
    state = prefill_for(model, prompt.context + prompt.probe, pruner.requirements(), reserve=task.max_new_tokens)
    own = greedy_decode(model, state, None, task.max_new_tokens, stop_tokens(model, tokenizer), num_variants=1)[0]
    prompt.answers = [tokenizer.decode(own)]
    full, drops = task_drop(model, tokenizer, prompt, pruner, 0.9, batch_size=3)  # two batches over 4 layers
    hand_full, hand = hand_drops(model, tokenizer, prompt, pruner, 0.9)
    assert full == hand_full == 1.0
    assert drops.shape == (4,)
    assert np.allclose(drops, hand, atol=1e-9)
    assert len(set(drops.tolist())) > 1  # pruning 90% of a layer changes some answers of a random model, not all alike
    assert ((drops >= 0) & (drops <= 1)).all()


def test_task_drop_needs_answers_and_the_profile_logs_score_then_drops():
    model = tiny_llama()
    prompt = sample(seed=1)
    settings = ProfileSettings(signal="evict", batch_size=8)
    assert settings.kind == "evict-task-drop" and settings.ratio() == 0.6
    with pytest.raises(UserError, match="no gold answers"):
        profile_unit(settings, (model, WordTokenizer()), (0, prompt))
    prompt.answers = ["w1 w2 w3"]
    value = profile_unit(settings, (model, WordTokenizer()), (0, prompt))
    full, drops = task_drop(model, WordTokenizer(), prompt, make_method("h2o"), 0.6)
    assert value.shape == (1, 5) and value[0, 0] == full and np.allclose(value[0, 1:], drops)


def test_kept_count_and_bad_ratios():
    assert kept_count(1000, 0.6) == 400 and kept_count(3, 0.9) == 1 and kept_count(10, 0.0) == 10
    for ratio in (0.0, 1.0, -0.2, float("nan")):
        with pytest.raises(UserError, match="--prune-ratio"):
            ProfileSettings(signal="evict", prune_ratio=ratio).check()
    with pytest.raises(UserError, match="unknown measure"):
        ProfileSettings(signal="evict", measure="f1").check()
    assert "measure" not in ProfileSettings().record()  # a noise profile records no eviction settings
    kl = ProfileSettings(signal="evict", measure="kl").record()  # as a KL profile was recorded before the task drop
    assert "prune_ratio" not in kl and "measure" not in kl and kl["evict_budget"] == 128
    assert ProfileSettings(signal="evict", measure="kl", prune_ratio=0.5).record()["measure"] == "kl"


def test_anchor_losses_equal_a_plain_loop():
    rng = np.random.default_rng(0)
    views = rng.normal(size=(5, 2, 3, 7))  # 5 prompts, 2 views, 3 layers, d = 7
    losses = anchor_losses(views, temperature=0.1)
    assert losses.shape == (5, 3)
    for layer in range(3):
        for i in range(5):
            a = views[i, 0, layer] / np.linalg.norm(views[i, 0, layer])
            logits = []
            for j in range(5):
                b = views[j, 1, layer] / np.linalg.norm(views[j, 1, layer])
                logits.append(float(a @ b) / 0.1)
            expected = -logits[i] + math.log(sum(math.exp(x) for x in logits))
            assert losses[i, layer] == pytest.approx(expected, rel=1e-10)
    # Identical views of orthogonal prompts: each term is log(1 + 3 e^(-1/tau)), the bound nearly 1; shuffled
    # pairs do far worse.
    same = np.repeat(np.eye(4)[:, None, None, :] * 10, 2, axis=1)
    assert np.allclose(anchor_losses(same), math.log(1 + 3 * math.exp(-10)), rtol=1e-12)
    assert mutual_information_bound(anchor_losses(same).mean(0), 4) == pytest.approx([1.0], abs=1e-3)
    shuffled = same.copy()
    shuffled[:, 1] = same[[1, 2, 3, 0], 1]
    assert anchor_losses(shuffled).min() > 10


def test_pooled_layers_are_the_mean_of_each_layers_hidden_states():
    model = tiny_qwen2()
    ids = list(range(3, 40))
    pooled = pooled_layers(model, ids)
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert pooled.shape == (4, 64)
    # hidden_states[l + 1] is layer l's output, except the last, which transformers gives after the final norm
    for layer in range(3):
        assert np.allclose(pooled[layer], hidden[layer + 1][0].mean(0).numpy(), atol=1e-5)
    views = [view_ids(ids, 0.1, seed) for seed in (0, 1)]
    assert views[0] != views[1] and views[0][0] == ids[0] and all(len(v) < len(ids) for v in views)


def test_infonce_profile_summary_reads_the_bound_as_sensitivity():
    model = tiny_llama()
    settings = ProfileSettings(signal="infonce")
    prompts = [sample(seed) for seed in range(4)]
    values = np.stack([profile_unit(settings, (model, None), (i, p)) for i, p in enumerate(prompts)])
    from ripplekv.pipeline.signals import FINISHERS

    per_seed, extra = FINISHERS["infonce"](values)
    assert per_seed.shape == (4, 1, 4)
    bound = 1 - per_seed[:, 0].mean(0) / math.log(4)
    assert np.allclose(extra["infonce_mi_bound"], bound)
    profile = Profile([p.sample_id for p in prompts], per_seed.mean(1), per_seed, settings, "tiny", extra=extra)
    table = profile.summary()
    assert list(table.columns) == ["layer", "infonce_mean", "infonce_std", "infonce_median", "n_samples", "sensitivity"]
    assert np.allclose(table["sensitivity"], np.maximum(bound, 0))


def write_fake_profile(folder, signal, column, values, ids, measure=None):
    """A profile folder as `write_profile` leaves it: per_sample.csv (one seed) and profile.json."""
    import json

    import pandas as pd

    folder.mkdir()
    rows = [{"sample_id": sid, "seed": 0, "layer": layer, column: float(values[i, layer])}
            for i, sid in enumerate(ids) for layer in range(values.shape[1])]
    pd.DataFrame(rows).to_csv(folder / "per_sample.csv", index=False)
    meta = {"signal": signal, "calibration_ids": list(ids), **({"measure": measure} if measure else {})}
    (folder / "profile.json").write_text(json.dumps(meta))
    return folder


def test_predictor_table_ranks_signals_against_the_drop(tmp_path):
    from scipy.stats import spearmanr

    from ripplekv.analysis.predictors import predictor_table

    rng = np.random.default_rng(0)
    layers, ids = 8, [f"c{i}" for i in range(10)]
    truth = np.linspace(0.0, 0.7, layers)
    drop = truth + rng.normal(0, 0.05, size=(10, layers))
    good = 2 * truth + rng.normal(0, 0.02, size=(10, layers))  # ranks layers as the drop does
    infonce = 3 - truth + rng.normal(0, 0.02, size=(10, layers))  # a loss: lower where the drop is higher
    noise = rng.normal(0, 1, size=(10, layers))
    drop_dir = write_fake_profile(tmp_path / "drop", "evict", "drop", drop, ids, measure="task-drop")
    folders = [write_fake_profile(tmp_path / "kl", "evict", "kl", good, ids),
               write_fake_profile(tmp_path / "infonce", "infonce", "infonce", infonce, ids[:6]),
               write_fake_profile(tmp_path / "noise", "noise", "kl", noise, [f"other{i}" for i in range(10)])]
    table = predictor_table(drop_dir, folders, resamples=300)
    assert list(table["signal"]) == ["evict (kl)", "infonce", "noise"]
    assert table["spearman"][0] == pytest.approx(spearmanr(good.mean(0), drop.mean(0)).statistic)
    assert table["spearman"][0] > 0.9 and table["low"][0] > 0.5
    assert bool(table["paired"][1]) and table["samples_drop"][1] == 6  # only the shared samples, paired
    assert table["spearman"][1] == pytest.approx(spearmanr(-infonce.mean(0), drop[:6].mean(0)).statistic) and table["spearman"][1] > 0.9
    assert not table["paired"][2] and table["low"][2] < table["spearman"][2] < table["high"][2]
    assert table["low"][2] < 0.5  # an unrelated signal's interval is wide
    with pytest.raises(UserError, match="not a task-drop profile"):
        predictor_table(folders[0], [drop_dir])


def test_draws_of_a_profile_pool_into_one_and_must_be_disjoint(tmp_path):
    from ripplekv.analysis.predictors import predictor_table, read_layer_profile

    rng = np.random.default_rng(1)
    layers = 6
    truth = np.linspace(0.0, 0.5, layers)
    values = truth + rng.normal(0, 0.05, size=(18, layers))
    ids = [f"c{i}" for i in range(18)]
    drops = [write_fake_profile(tmp_path / f"drop{d}", "evict", "drop", values[d::3], ids[d::3], measure="task-drop")
             for d in range(3)]
    kls = [write_fake_profile(tmp_path / f"kl{d}", "evict", "kl", 2 * values[d::3], ids[d::3]) for d in range(3)]
    pooled = read_layer_profile(",".join(map(str, drops)))
    assert len(pooled.sample_ids) == 18 and pooled.values.shape == (18, layers)
    table = predictor_table(",".join(map(str, drops)), [",".join(map(str, kls))], resamples=100)
    assert table["samples_drop"][0] == 18 and bool(table["paired"][0]) and table["spearman"][0] == pytest.approx(1.0)
    with pytest.raises(UserError, match="share calibration samples"):
        read_layer_profile([drops[0], drops[0]])
    with pytest.raises(UserError, match="pool only draws of one profile"):
        read_layer_profile([drops[0], kls[1]])
