"""KVzap's surrogates fitted on calibration prompts (never evaluated ones), resumable, with their held-out fit.

The paper's protocol at our scale: each calibration prompt (`ripplekv profile`'s: the offline suite's
calibration split, disjoint from every evaluated sample) is prefilled once, recording every layer's
attention input; our KVzip scorer's reconstruction pass scores its entries, and `tokens` random positions
(past the sinks, whose KVzip score is fixed) give (hidden state, log score per KV head) pairs. Each prompt's
pairs land in `samples/ID.npz` and one line of `samples.jsonl` as soon as they are done, so a killed run
resumes and other settings are refused. Every `holdout`-th prompt is held out: the surrogates (`mlp`,
`linear`) are fitted on the rest and their rank correlation with KVzip's scores on the held-out pairs,
per layer, goes into each weights file's provenance (`kvzap-KIND.safetensors` + `.json`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ripplekv.errors import UserError
from ripplekv.methods.kvzap import surrogate as kvzap_surrogate
from ripplekv.pipeline import prompt_log
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import exclusive
from ripplekv.tasks.calibration import Calibration

LOG = prompt_log.LOG
N_SINK, CHUNK = 4, 2048  # our KVzip scorer's defaults (its reconstruction pass)
FLOOR = 1e-10  # KVzip scores below this (no query attends) are taken as this before the log
PAIRS = {"targets": f"log max(KVzip score, {FLOOR}), our kvzip scorer (n_sink {N_SINK}, chunk {CHUNK})",
         "inputs": "each layer's attention input (after its input norm)"}  # what the pairs are, in each header


@dataclass(frozen=True)
class FitSettings:
    """What determines the fitted surrogates beside their calibration prompts (the log's header and each file's
    provenance)."""

    tokens: int = 500  # sampled positions per prompt (the paper's 500)
    holdout: int = 4  # every holdout-th prompt is held out for the reported fit
    epochs: int = 15
    seed: int = 0

    def check(self, calibration: Calibration) -> None:
        if min(self.tokens, self.epochs) < 1 or self.holdout < 2:
            raise UserError("--tokens and --epochs must be positive and --holdout at least 2")
        if calibration.samples < self.holdout:
            raise UserError(f"--calib-samples ({calibration.samples}) must be at least --holdout ({self.holdout}): "
                            "one prompt in every --holdout is held out to measure the fit")

    def record(self, calibration: Calibration) -> dict:
        """The settings as the log's header and the provenance name them (in the order they always had)."""
        return {"calib_samples": calibration.samples, "target_tokens": calibration.target_tokens, **asdict(self),
                **calibration.record()}


def prompt_pairs(model, tokenizer, ids: list[int], tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(hidden [L, k, D] float32, log KVzip scores [L, k, H]) at k random positions past the sinks of one prompt."""
    from ripplekv.engine.prefill import Requirements, prefill_for
    from ripplekv.engine.recorders import SampleContext
    from ripplekv.methods.kvzap.method import HIDDEN_STATES
    from ripplekv.methods.kvzip import TOKENIZER, reconstruction_scores

    state = prefill_for(model, ids, Requirements(signals={HIDDEN_STATES, TOKENIZER}),
                        context=SampleContext(tokenizer=tokenizer))
    scores = reconstruction_scores(state, N_SINK, CHUNK)  # [L, H, n]
    candidates = np.arange(N_SINK, state.length)
    chosen = np.sort(np.random.default_rng(seed).choice(candidates, min(tokens, len(candidates)), replace=False))
    picked = torch.as_tensor(chosen, device=state.device)
    hidden = torch.stack([h[picked].float() for h in state.signal(HIDDEN_STATES)]).cpu().numpy()
    targets = torch.log(scores[:, :, picked].clamp_min(FLOOR)).transpose(1, 2).cpu().numpy()
    return hidden, targets


def stacked(folder: Path, names: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (inputs [N, D], targets [N, H]) over the prompts `names`."""
    loaded = [np.load(folder / name) for name in names]
    hidden = np.concatenate([d["hidden"] for d in loaded], axis=1)
    targets = np.concatenate([d["targets"] for d in loaded], axis=1)
    return [torch.from_numpy(h) for h in hidden], [torch.from_numpy(t) for t in targets]


def held_out_fit(predicted: list[np.ndarray], truths: list[np.ndarray]) -> dict:
    """Rank correlation (mean over KV heads) and R^2 of predictions [N, H] against the targets, per layer, on held-out
    pairs (KVzap's log scores, FastKVzip's scores)."""
    ranks, r2 = [], []
    for guess, truth in zip(predicted, truths):
        ranks.append(float(np.mean([kvzap_surrogate.spearman(guess[:, h], truth[:, h]) for h in range(truth.shape[1])])))
        r2.append(float(1 - ((guess - truth) ** 2).sum() / ((truth - truth.mean(0)) ** 2).sum()))
    return {"spearman_per_layer": [round(v, 4) for v in ranks], "r2_per_layer": [round(v, 4) for v in r2],
            "spearman_mean": round(float(np.mean(ranks)), 4), "r2_mean": round(float(np.mean(r2)), 4)}


def collect(out: Path, header: dict, prompts, model: ModelChoice, tokens: int, seed: int, bar=None) -> list[dict]:
    """Each prompt's pairs in `out`/samples (those already in the log kept: a resumed run collects the rest), under
    the fit's lock; the log's entries in prompt order. `bar(total, done)` gives (context manager, advance)."""

    def measure(loaded, tokenizer, ids, index):
        hidden, targets = prompt_pairs(loaded, tokenizer, ids, tokens, seed + index)
        return {"hidden": hidden, "targets": targets}

    return prompt_log.collect(out, header, prompts, model, "pairs", measure, bar)


def split(done: list[dict], holdout: int) -> tuple[list[str], list[str]]:
    """(training pair files, held-out ones): every `holdout`-th prompt is held out."""
    held = [d["pairs"] for i, d in enumerate(done) if i % holdout == holdout - 1]
    return [d["pairs"] for d in done if d["pairs"] not in held], held


def collected(header: dict, done: list[dict], train: list[str], held: list[str], inputs, test_inputs) -> dict:
    """The provenance every fit writes beside its weights: the header and what the pairs were."""
    return {**header, "train_prompts": len(train), "held_out_prompts": len(held),
            "train_pairs": int(inputs[0].shape[0]), "held_out_pairs": int(test_inputs[0].shape[0])}


def fit_surrogates(out: Path, model: ModelChoice, settings: FitSettings, calibration: Calibration,
                   kinds=kvzap_surrogate.KINDS, bar=None, announce=None) -> dict[str, tuple[Path, dict]]:
    """Collect (or resume) the pairs of `calibration`'s prompts into `out`, fit each surrogate of `kinds`; kind ->
    (weights file, held-out fit). `bar(total, done)` gives (context manager, advance) for a progress bar;
    `announce()` is called once every input has been checked (so bad input stays one line)."""
    calibration.check()
    settings.check(calibration)
    for kind in kinds:
        kvzap_surrogate.build(kind, 1, 1, 0)  # an unknown kind is one line before any work
    out = Path(out)
    owned = [f"kvzap-{k}.{s}" for k in kvzap_surrogate.KINDS for s in ("safetensors", "json")]
    model, prompts, header = prompt_log.prepare(out, owned, model, settings.record(calibration), calibration, PAIRS)
    if announce is not None:
        announce()
    with exclusive(out, "kvzap fit"):
        done = collect(out, header, prompts, model, settings.tokens, settings.seed, bar)
        train, held = split(done, settings.holdout)
        inputs, targets = stacked(out, train)
        test_inputs, test_targets = stacked(out, held)
        written = {}
        for kind in kinds:
            begun = time.perf_counter()
            torch.manual_seed(settings.seed)
            layers = kvzap_surrogate.fit(kind, inputs, targets, epochs=settings.epochs)
            fit = held_out_fit([kvzap_surrogate.predict(m, x).T.numpy() for m, x in zip(layers, test_inputs)],
                               [y.numpy() for y in test_targets])
            provenance = {**collected(header, done, train, held, inputs, test_inputs),
                          "held_out_fit": fit, "prompt_tokens": [d["tokens"] for d in done],
                          "collect_seconds": round(sum(d["seconds"] for d in done), 1),
                          "fit_seconds": round(time.perf_counter() - begun, 1)}
            path = kvzap_surrogate.save(out / f"kvzap-{kind}.safetensors", kind, layers, provenance)
            written[kind] = (path, fit)
    return written
