"""Head-budget curves (LU-KV's offline profile) on calibration prompts, one file per scorer with its provenance.

The calibration prompts are `ripplekv profile`'s (the offline suite's calibration split, disjoint from every
evaluated sample). Each prompt is prefilled once for all the methods' scorers; its oracle importance and
each scorer's per-prompt greedy curve (`methods.lukv.oracle.prompt_curves`) are appended to
`samples.jsonl` as soon as they are done, so a killed run resumes where it stopped and other settings
are refused. The curve of a scorer is the mean of its per-prompt curves (the reference's averaging),
written as `curve-SCORER.csv` (rows ratio,layer,head,prune) with `curve-SCORER.json` (model, scorer,
protected entries, greedy settings, calibration ids and hash); a method reads it as `SPEC:curve=FILE`.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.lukv.greedy import FLOOR_SHARE, RATIOS
from ripplekv.methods.lukv.method import LUKV, protected, scorer_identity
from ripplekv.methods.lukv.oracle import ANSWER_TOKENS, prompt_curves
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import UnitLog, exclusive, other_files, write_csv, write_text
from ripplekv.tasks.calibration import Calibration, calibration_hash

LOG = "samples.jsonl"


@dataclass(frozen=True)
class CurveSettings:
    """What determines the curves beside their calibration prompts (the log's header and each curve's provenance)."""

    answer_tokens: int = ANSWER_TOKENS
    layerwise: bool = True

    def check(self) -> None:
        if self.answer_tokens < 1:
            raise UserError(f"--answer-tokens must be positive, got {self.answer_tokens}")

    def record(self, calibration: Calibration) -> dict:
        """The settings as the log's header and the provenance name them (in the order they always had)."""
        return {"calib_samples": calibration.samples, "target_tokens": calibration.target_tokens, **asdict(self),
                **calibration.record()}


def write_curve(path: str | Path, curve: np.ndarray, provenance: dict) -> Path:
    """The curve [99, L, H] as `ratio,layer,head,prune` rows, its provenance as JSON beside it."""
    import pandas as pd

    path = Path(path)
    rows, layers, heads = curve.shape
    index = np.indices((rows, layers, heads)).reshape(3, -1)
    frame = pd.DataFrame({"ratio": np.round(RATIOS[index[0]], 2), "layer": index[1], "head": index[2],
                          "prune": curve.reshape(-1)})
    write_csv(path, frame)
    write_text(path.with_suffix(".json"), json.dumps(provenance, indent=2) + "\n")
    return path


def curve_scorers(specs: list[str]) -> dict:
    """scorer name -> scorer, for method specs whose budgets come from a curve (one curve per scorer)."""
    scorers = {}
    for spec in specs:
        method = make_method(spec)
        if not isinstance(getattr(method, "allocator", None), LUKV):
            raise UserError(f"{spec} does not read a head-budget curve; name methods whose allocator is LU-KV's")
        scorer = method.scorer
        if scorer.name in scorers and scorer_identity(scorers[scorer.name]) != scorer_identity(scorer):
            raise UserError(f"two methods score with {scorer.name} under other options; profile them in two runs")
        scorers[scorer.name] = scorer
    if not scorers:
        raise UserError("name at least one method to profile a curve for (--methods)")
    return scorers


def curve_files(names) -> list[str]:
    return [LOG] + [f"curve-{name}.{suffix}" for name in names for suffix in ("csv", "json")]


def profile_curves(out: Path, model: ModelChoice, specs: list[str], settings: CurveSettings,
                   calibration: Calibration, bar=None, announce=None) -> dict[str, Path]:
    """Profile (or resume) the curves of `specs`' scorers on `calibration`'s prompts into `out`; returns scorer
    name -> curve file. `bar(total, done)` gives (context manager, advance) for a progress bar; `announce()` is
    called once every input has been checked (so bad input stays one line)."""
    from ripplekv.engine.models import load_tokenizer, resolve_model

    calibration.check()
    settings.check()
    scorers = curve_scorers(specs)
    foreign = other_files(Path(out), curve_files(scorers))
    if foreign:
        raise UserError(f"--out {out} holds other files ({', '.join(foreign[:3])}); pass a new or empty directory")
    model = model.resolved()
    source = resolve_model(model.spec)
    prompts = calibration.prompts(load_tokenizer(model.spec))
    header = {"model": source.label, **settings.record(calibration),
              "scorers": {n: scorer_identity(s) for n, s in scorers.items()},
              "calibration_ids": [p.sample_id for p in prompts], "calibration_hash": calibration_hash(prompts)}
    if announce is not None:
        announce()
    with exclusive(Path(out), "head-curve profile"):
        log = UnitLog(Path(out) / LOG, header, remedy="use a new --out directory")
        todo = [p for p in prompts if p.sample_id not in log.done]
        if todo:
            loaded, loaded_tokenizer, _ = model.load()
            context, advance = bar(len(prompts), len(prompts) - len(todo)) if bar else (nullcontext(), None)
            with context:
                for index, prompt in enumerate(todo):
                    begun = time.perf_counter()
                    curves, answer = prompt_curves(loaded, loaded_tokenizer, prompt.context + prompt.probe, scorers,
                                                   settings.layerwise, settings.answer_tokens)
                    log.append(prompt.sample_id, {"answer_tokens": answer, "tokens": len(prompt.context + prompt.probe),
                                                  "seconds": round(time.perf_counter() - begun, 2),
                                                  "curves": {n: c.round(8).tolist() for n, c in curves.items()}})
                    if advance is not None:
                        advance(index)
        done = [log.done[p.sample_id] for p in prompts]
        written = {}
        for name, scorer in scorers.items():
            curve = np.mean([np.asarray(d["curves"][name]) for d in done], axis=0)
            sink, window = protected(scorer)
            provenance = {**header, "scorer": scorer_identity(scorer), "sink": sink, "window": window,
                          "floor_share": FLOOR_SHARE, "oracle_queries": "the full cache's greedy answer",
                          "prompt_tokens": [d["tokens"] for d in done], "answer_lengths": [d["answer_tokens"] for d in done],
                          "profile_seconds": round(sum(d["seconds"] for d in done), 1)}
            provenance.pop("scorers")
            written[name] = write_curve(Path(out) / f"curve-{name}.csv", curve, provenance)
    return written
