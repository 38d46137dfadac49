"""PyramidKV: budgets fall linearly with depth, SnapKV scoring inside each layer.

The schedule is PyramidKV's: beyond the window, layer 0 gets (2 - 1/beta) times and the last layer
1/beta times the average. Unlike the common implementation (integer steps that keep ~4.6% more than
uniform at B=128), our integer budgets sum exactly to L*B.
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.methods.base import register
from ripplekv.methods.snapkv import SnapScored


@register("pyramidkv")
@dataclass(frozen=True)
class PyramidKV(SnapScored):
    name = "pyramidkv"
    beta: float = 20.0

    def layer_targets(self, num_layers, budget):
        spare = max(budget - self.window, 0)
        low = spare / self.beta
        high = 2 * spare - low
        if num_layers == 1:
            return [float(budget)]
        step = (high - low) / (num_layers - 1)
        return [self.window + high - step * layer for layer in range(num_layers)]
