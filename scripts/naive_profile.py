"""The naive one-layer-at-a-time profiler peers use: a fresh prefill per perturbed layer, stock attention.

It is the reference the batched profile (`ripplekv.pipeline.profile`) is tested and benchmarked against
(tests/test_profile.py, scripts/bench_profile.py), so it lives with the benchmarks, not in the package.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from ripplekv.engine import entries
from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import forward_tokens, kl_per_variant
from ripplekv.engine.prefill import prefill, prefill_for
from ripplekv.pipeline.profile import CalibrationPrompt, ProfileSettings, layer_overrides, profile_requirements


@torch.inference_mode()
def profile_prompt_one_layer_at_a_time(model, prompt: CalibrationPrompt, settings: ProfileSettings, sample_index: int):
    """The naive way peers do it: a fresh prefill per perturbed layer, stock attention and cache.

    """
    from ripplekv.engine import cache as kvcache  # noqa: F401

    kvcache.install(model)
    context = torch.tensor(prompt.context, dtype=torch.long)[None]
    probe = torch.tensor(prompt.probe, dtype=torch.long)[None]
    start = context.shape[1]
    positions = torch.arange(start, start + probe.shape[1])[None]

    def probe_logprobs(delta_layer=None, delta=None):
        cache = DynamicCache(config=model.config)
        model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
        if delta is not None:  # a sliding layer's stock cache holds only its window's last entries
            held = cache.layers[delta_layer].values.shape[-2]
            cache.layers[delta_layer].values = cache.layers[delta_layer].values + delta[None, :, delta.shape[1] - held :]
        out = model(input_ids=probe, position_ids=positions, cache=cache, use_cache=True)
        return torch.log_softmax(out.logits[0].float(), -1)

    def evicted_logprobs(layer, keep):
        # Stock attention cannot hold one shorter layer, so the evicted layer goes through our cache.
        fresh = prefill(model, prompt.context, capture_window=max(64, settings.probe_tokens))
        layers = [fresh.full_entries(i) for i in range(fresh.num_layers)]
        layers[layer] = entries.gather(fresh.keys[layer], fresh.values[layer], keep)
        cache = build_cache(fresh, [layers])
        return torch.log_softmax(forward_tokens(model, cache, probe, start)[0], -1)

    clean = probe_logprobs()
    state = prefill_for(model, prompt.context, profile_requirements(settings))  # the evict pruner's needs (H2O: accumulated attention)
    num_layers = state.num_layers
    seeds = settings.seeds if settings.signal == "noise" else 1
    result = np.zeros((seeds, num_layers))
    for seed in range(seeds):
        overrides = layer_overrides(state, settings, seed, sample_index)
        for layer, override in enumerate(overrides):
            if override.value_delta is not None:
                perturbed = probe_logprobs(layer, override.value_delta)
            else:
                perturbed = evicted_logprobs(layer, torch.isfinite(override.key_bias))
            result[seed, layer] = float(kl_per_variant(clean, perturbed))
    return result
