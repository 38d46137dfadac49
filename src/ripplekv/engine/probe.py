"""The probe runner: teacher-forced probe tokens over one prefilled context, for many single-layer changes.

`ripplekv profile` (noise or eviction in one layer) and `ripplekv route` (one method's eviction in one
layer) both measure KL(clean || changed) at the probe tokens with it.
"""

from __future__ import annotations

import numpy as np
import torch

from ripplekv.engine import adapter
from ripplekv.engine.cache import CompressedCache, CompressedLayer, VariantOverride
from ripplekv.engine.decode import kl_per_variant


class ProbeRunner:
    """Runs the probe tokens over one prefilled context for many single-layer changes.

    A variant changed in layer l equals the clean run below layer l, so it joins the batch only at
    layer l, starting from the clean hidden state there: the batch grows with depth and about half of
    the layer passes are saved. Several variants may join at one layer (routing's (layer, method)
    trials): their key biases (-inf evicts) become that layer's per-variant prompt bias, so no K/V is
    copied. Everything runs through the model's own decoder layers.
    """

    def __init__(self, model, state, probe_ids: list[int]):
        self.model, self.state = model, state
        self.probe = torch.tensor(probe_ids, dtype=torch.long, device=state.device)[None]
        self.positions = torch.arange(state.length, state.length + self.probe.shape[1], device=state.device)[None]
        self.layers = [  # every prompt position; a sliding layer sees its window of them, as the model does
            CompressedLayer(state.keys[i][None], state.values[i][None], None, state.length).slide(state.window(i))
            for i in range(state.num_layers)
        ]
        self.clean_inputs: list[torch.Tensor] = []
        self.clean = self._run([], [])[0]

    def _prepare(self, joins: list[int], changes: list[VariantOverride]) -> None:
        """Set each layer's changes for rows that join there (rows are ordered by the layer they join at)."""
        for layer in self.layers:
            layer.keys = layer.values = layer.override = layer.prompt_bias = None
        for index, layer in enumerate(self.layers):
            rows = [row for row, join in enumerate(joins) if join == index]
            biased = [row for row in rows if changes[row].key_bias is not None]
            shifted = [row for row in rows if changes[row].value_delta is not None]
            if len(shifted) > 1:
                raise ValueError("at most one value perturbation per layer and pass")
            if shifted:
                layer.override = VariantOverride(shifted[0], value_delta=changes[shifted[0]].value_delta)
            if biased:
                bias = torch.zeros(rows[-1] + 1, *changes[biased[0]].key_bias.shape, device=self.state.device)
                for row in biased:
                    bias[row] = changes[row].key_bias
                layer.prompt_bias = bias

    def _run(self, joins: list[int], changes: list[VariantOverride]) -> torch.Tensor:
        """Log-probs [rows, P, vocab]: row r is the clean run changed by changes[r] in layer joins[r]
        (`joins` nondecreasing). With no rows: the clean run, recording each layer's clean input."""
        record = not joins
        cache = CompressedCache(self.layers, max(1, len(joins)))
        self._prepare(joins, changes)
        counts = np.bincount(np.asarray(joins, dtype=np.int64), minlength=len(self.layers))
        hidden = adapter.embed(self.model, self.probe) if record else None
        rotary = adapter.rotary_by_layer(self.model, hidden if record else self.clean_inputs[0], self.positions)
        for index, decoder in enumerate(adapter.decoder_layers(self.model)):
            if record:
                self.clean_inputs.append(hidden)
            elif counts[index]:
                joining = self.clean_inputs[index].repeat(int(counts[index]), 1, 1)
                hidden = joining if hidden is None else torch.cat([hidden, joining])
            if hidden is None:
                continue
            hidden = decoder(
                hidden,
                attention_mask=None,
                position_ids=self.positions,
                cache=cache,
                use_cache=True,
                position_embeddings=rotary[index],
                ripplekv_cache=cache,
            )
        return torch.log_softmax(adapter.logits(self.model, hidden), -1)

    def perturbed_kl(self, changes: list[VariantOverride], batch_size: int, layers: list[int] | None = None) -> np.ndarray:
        """KL(clean || variant) for each change, applied in layer `layers[i]` (default: change i in layer i);
        `batch_size` variants per pass, grouped by the layer they join at."""
        layers = list(range(len(changes))) if layers is None else list(layers)
        order = np.argsort(np.asarray(layers), kind="stable")
        result = np.zeros(len(changes))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            logprobs = self._run([layers[i] for i in chunk], [changes[i] for i in chunk])
            result[chunk] = kl_per_variant(self.clean[None], logprobs).cpu().numpy()
        return result
