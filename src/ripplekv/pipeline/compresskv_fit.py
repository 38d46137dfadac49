"""CompressKV's offline layer profile on calibration prompts (never evaluated ones): `ripplekv fit compresskv`.

Each calibration prompt is prefilled once; a layer's error is the relative Frobenius error of its window
queries' attention output (after W_o) when its cache keeps only SnapKV's selection at `budget`
(`methods.compresskv.layer_errors`), averaged over the prompts in their order. The `layer,error` CSV it
writes is what `compresskv:profile=FILE` reads. Its cost is one prefill per calibration prompt, once per
model, so it is not resumable; every setting is checked before the model loads.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.tasks.calibration import Calibration


@dataclass(frozen=True)
class LayerErrorSettings:
    """`budget`: the small selection a layer's error is measured at; `window`: the queries standing in for decoding."""

    budget: int = 128
    window: int = 32

    def check(self) -> None:
        from ripplekv.methods.core.budgets import check_budget

        if self.window < 1:
            raise UserError(f"--window must be at least 1, got {self.window}")
        check_budget(self.budget)


def check_compresskv_fit(out: str | Path, model: ModelChoice, settings: LayerErrorSettings,
                         calibration: Calibration) -> None:
    """Every setting and the output, before any model work (the output's folder is made when missing)."""
    from ripplekv.engine.models import resolve_model
    from ripplekv.runs.safeio import check_output

    calibration.check()
    settings.check()
    source = resolve_model(model.spec)
    check_output(out, inputs=[source.location] if source.kind == "gguf" else [])  # a file


def fit_compresskv(out: str | Path, model: ModelChoice, settings: LayerErrorSettings, calibration: Calibration,
                   bar=None) -> tuple[Path, list[float], int]:
    """Profile the layer errors on `calibration`'s prompts and write them; returns (the CSV, the errors, the
    prompt count). `bar(total, done)` gives (context manager, advance) for a progress bar."""
    from ripplekv.methods.compresskv import calibrate, write_profile

    check_compresskv_fit(out, model, settings, calibration)
    loaded, tokenizer, _ = model.load()
    prompts = calibration.prompts(tokenizer)
    context, advance = bar(len(prompts), 0) if bar else (nullcontext(), None)
    totals = None
    with context:
        for index, prompt in enumerate(prompts):  # one prompt at a time: the sum in `calibrate`'s order
            errors = calibrate(loaded, [prompt.context + prompt.probe], settings.budget, settings.window)
            totals = errors if totals is None else [a + b for a, b in zip(totals, errors)]
            if advance is not None:
                advance(index)
    errors = [total / len(prompts) for total in totals]
    written = write_profile(out, errors)
    write_provenance(written, settings, calibration, prompts)
    return written, errors, len(prompts)


def write_provenance(profile: Path, settings: LayerErrorSettings, calibration: Calibration, prompts) -> Path:
    """PROFILE.json beside the CSV: which calibration prompts it was measured on (a study's calibration table
    matches every calibrated method's prompts by their ids)."""
    from ripplekv.runs.safeio import write_json
    from ripplekv.tasks.calibration import calibration_hash

    path = profile.with_suffix(".json")
    write_json(path, {"budget": settings.budget, "window": settings.window, "target_tokens": calibration.target_tokens,
                      **calibration.record(), "calibration_ids": [p.sample_id for p in prompts],
                      "calibration_hash": calibration_hash(prompts)})
    return path
