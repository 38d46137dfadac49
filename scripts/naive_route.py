"""Routing preferences the naive way: a fresh prefill per (layer, method) trial.

The reference the batched preferences (`ripplekv.pipeline.route.preference_prompt`) are tested and benchmarked
against (tests/test_route.py, scripts/bench_route.py), so it lives with the benchmarks, not in the package.
"""

from __future__ import annotations

import numpy as np
import torch

from ripplekv.engine import entries
from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import forward_tokens, kl_per_variant
from ripplekv.pipeline.route import layer_keep, route_prefill


@torch.inference_mode()
def preferences_one_trial_at_a_time(model, prompt, candidates, budget: int, probe_tokens: int) -> np.ndarray:
    """KL [L, M]: for each (layer, method), prefill the context again, compress that layer, run the probe."""
    probe = torch.tensor(prompt.probe, dtype=torch.long)[None]
    start = len(prompt.context)

    def probe_logprobs(layer=None, method=None):
        state = route_prefill(model, prompt.context, candidates, probe_tokens, len(prompt.probe))
        layers = [state.full_entries(i) for i in range(state.num_layers)]
        if layer is not None:
            keep = layer_keep(state, method, layer, budget)
            layers[layer] = entries.gather(state.keys[layer], state.values[layer], keep)
        cache = build_cache(state, [layers])
        return torch.log_softmax(forward_tokens(model, cache, probe.to(state.device), start)[0], -1), state.num_layers

    clean, num_layers = probe_logprobs()
    result = np.zeros((num_layers, len(candidates)))
    for layer in range(num_layers):
        for index, method in enumerate(candidates):
            perturbed, _ = probe_logprobs(layer, method)
            result[layer, index] = float(kl_per_variant(clean, perturbed))
    return result
