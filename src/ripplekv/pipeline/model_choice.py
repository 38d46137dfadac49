"""Which model a stage runs, on which device and in which dtype (`--model`, `--device`, `--dtype`).

Every stage that loads a model takes these three together; one object carries them, so a stage's settings
stay a few objects rather than a long argument list.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelChoice:
    """`spec`: a hub id, folder or .gguf (None: the bundled model); `device` and `dtype` as the options take them."""

    spec: str | None = None
    device: str = "auto"
    dtype: str = "auto"

    def resolved(self) -> ModelChoice:
        """The same choice with a concrete device and dtype (auto: CUDA + bfloat16 with a GPU, else CPU + float32)."""
        from ripplekv.engine.models import resolve_device_dtype

        device, dtype = resolve_device_dtype(self.device, self.dtype)
        return ModelChoice(self.spec, device, dtype)

    def load(self):
        """(model, tokenizer, source), as `engine.models.load_model` returns them."""
        from ripplekv.engine.models import load_model

        return load_model(self.spec, device=self.device, dtype=self.dtype)
