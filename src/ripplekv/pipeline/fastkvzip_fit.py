"""FastKVzip's gates fitted on calibration prompts (never evaluated ones), resumable, with their held-out fit.

The pairs are KVzap's (`pipeline.kvzap_fit`, the same code): each calibration prompt (the offline suite's
calibration split) is prefilled once recording every layer's attention input, our KVzip scorer's reconstruction
pass scores its entries, and `tokens` random positions past the sinks become (hidden state, KVzip score per KV
head) pairs, in `samples/ID.npz` and `samples.jsonl` as soon as a prompt is done, so a killed run resumes. The
gates (`methods.fastkvzip.gate`) are fitted on the KVzip scores themselves (the authors' binary cross-entropy),
with `group` queries per KV head (the model's query heads per KV head, as the published gates have). Every
`holdout`-th prompt is held out; the gates' rank correlation and R^2 against KVzip's scores there, per layer,
go into the provenance beside `fastkvzip.safetensors`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ripplekv.engine.config_shape import config_shape
from ripplekv.errors import UserError
from ripplekv.methods.fastkvzip import gate as fastkvzip_gate
from ripplekv.pipeline import kvzap_fit, prompt_log
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import exclusive
from ripplekv.tasks.calibration import Calibration

WEIGHTS = "fastkvzip.safetensors"


@dataclass(frozen=True)
class GateSettings:
    """The pairs (`tokens`, `holdout`, `seed`: the log's header, so a resumed run collects the same) and the
    training (`steps`, `batch`, `lr`: the provenance only, so the gates can be refitted on the pairs collected)."""

    tokens: int = 500
    holdout: int = 4
    seed: int = 0
    steps: int = fastkvzip_gate.STEPS
    batch: int = fastkvzip_gate.BATCH
    lr: float = fastkvzip_gate.LR

    def check(self, calibration: Calibration) -> None:
        if min(self.tokens, self.steps, self.batch) < 1 or self.holdout < 2 or not self.lr > 0:
            raise UserError("--tokens, --steps, --batch and --lr must be positive and --holdout at least 2")
        if calibration.samples < self.holdout:
            raise UserError(f"--calib-samples ({calibration.samples}) must be at least --holdout ({self.holdout}): "
                            "one prompt in every --holdout is held out to measure the fit")

    def pairs(self, calibration: Calibration) -> dict:
        return {"calib_samples": calibration.samples, "target_tokens": calibration.target_tokens,
                "tokens": self.tokens, "holdout": self.holdout, "seed": self.seed, **calibration.record()}


def scores_of(targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """KVzip's scores from the logged log scores (a score below the log's floor comes back as the floor)."""
    return [t.exp() for t in targets]


def fit_gates(out: Path, model: ModelChoice, settings: GateSettings, calibration: Calibration, bar=None,
              announce=None, layer_bar=None) -> tuple[Path, dict]:
    """Collect (or resume) the pairs of `calibration`'s prompts into `out` and fit a gate per layer: (weights file,
    held-out fit). `bar` and `announce` as `kvzap_fit.fit_surrogates` takes them; `layer_bar(total, done)` the same
    over the layers fitted."""
    calibration.check()
    settings.check(calibration)
    out = Path(out)
    owned = [WEIGHTS, WEIGHTS.replace(".safetensors", ".json")]
    model, prompts, header = prompt_log.prepare(out, owned, model, settings.pairs(calibration), calibration,
                                                kvzap_fit.PAIRS)
    group = config_shape(model.spec).group  # the gate's queries per KV head
    if announce is not None:
        announce()
    with exclusive(out, "fastkvzip fit"):
        done = kvzap_fit.collect(out, header, prompts, model, settings.tokens, settings.seed, bar)
        train, held = kvzap_fit.split(done, settings.holdout)
        inputs, targets = kvzap_fit.stacked(out, train)
        test_inputs, test_targets = kvzap_fit.stacked(out, held)
        begun = time.perf_counter()
        context, advance = layer_bar(len(inputs), 0) if layer_bar else (nullcontext(), None)
        gates = []
        with context:
            for layer, (x, y) in enumerate(zip(inputs, scores_of(targets))):
                gates.append(fastkvzip_gate.fit_gate(x, y, group, settings.steps, settings.lr, settings.batch,
                                                     settings.seed + layer))
                if advance is not None:
                    advance(layer)
        truths = [y.numpy() for y in scores_of(test_targets)]
        predicted = [fastkvzip_gate.predict(g, x).T.numpy() for g, x in zip(gates, test_inputs)]
        fit = kvzap_fit.held_out_fit(predicted, truths)
        fit["bce_mean"] = round(float(np.mean([fastkvzip_gate.loss(torch.from_numpy(p).T, torch.from_numpy(t).T.clamp(0, 1))
                                               / t.shape[1] for p, t in zip(predicted, truths)])), 4)
        provenance = {**kvzap_fit.collected(header, done, train, held, inputs, test_inputs),
                      "steps": settings.steps, "batch": settings.batch, "lr": settings.lr, "group": group,
                      "loss": "binary cross-entropy against KVzip's score", "held_out_fit": fit,
                      "prompt_tokens": [d["tokens"] for d in done],
                      "collect_seconds": round(sum(d["seconds"] for d in done), 1),
                      "fit_seconds": round(time.perf_counter() - begun, 1)}
        path = fastkvzip_gate.save(out / WEIGHTS, gates, provenance)
    return path, fit
