"""A model's layer and head counts read from its config, in one place.

A multimodal config (Gemma 3's) keeps them in `text_config`; a config without grouped-query attention has no
`num_key_value_heads` and one KV head per query head. Every caller that needs counts before (or without) a
prefill reads them here, so none of them forgets either case.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigShape:
    layers: int
    query_heads: int
    kv_heads: int
    hidden: int

    @classmethod
    def of(cls, config) -> ConfigShape:
        config = getattr(config, "text_config", None) or config
        query_heads = int(config.num_attention_heads)
        return cls(layers=int(config.num_hidden_layers), query_heads=query_heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or query_heads),
                   hidden=int(config.hidden_size))

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.query_heads // self.kv_heads


def config_shape(spec: str | None) -> ConfigShape:
    """The counts of model `spec` from its config alone, without loading weights."""
    from ripplekv.engine.models import load_config

    return ConfigShape.of(load_config(spec))
