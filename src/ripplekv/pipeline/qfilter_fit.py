"""Q-Filters' filters fitted on calibration prompts (never evaluated ones), resumable.

Each calibration prompt (`ripplekv profile`'s: the offline suite's calibration split, disjoint from every evaluated
sample) is prefilled once, recording per layer and query head the sum and the Gram matrix Q^T Q of its post-RoPE
queries (`methods.qfilter.filters.QUERY_SUMS`, float64 on the fly, stored in float32). Each prompt's sums land in
`samples/ID.npz` and one line of `samples.jsonl` as soon as they are done, so a killed run resumes and other
settings are refused. The filters come from the sums over every prompt (`filters.filters_from`): `qfilter.safetensors`
with `qfilter.json` (the model, the calibration ids and hash, the seconds each part took, and per layer the share of
the queries' energy along the direction and how far a KV head's query heads agree on it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ripplekv.engine.config_shape import config_shape
from ripplekv.methods.qfilter import filters as qfilters
from ripplekv.pipeline import prompt_log
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import exclusive
from ripplekv.tasks.calibration import Calibration

LOG = prompt_log.LOG
WEIGHTS = "qfilter.safetensors"


def prompt_sums(model, ids: list[int]) -> dict[str, np.ndarray]:
    """One prompt's query sums: `gram` [L, H_q, d, d] and `total` [L, H_q, d] (float32), `count` (positions)."""
    from ripplekv.engine.prefill import Requirements, prefill_for

    state = prefill_for(model, ids, Requirements(signals={qfilters.QUERY_SUMS}))
    sums = state.signal(qfilters.QUERY_SUMS)
    return {"gram": np.stack([s.gram.numpy() for s in sums]).astype(np.float32),
            "total": np.stack([s.total.numpy() for s in sums]).astype(np.float32),
            "count": np.asarray(sums[0].count)}


def summed(folder: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """(gram, total, positions) summed in float64 over the prompts' files `names`."""
    gram = total = None
    count = 0
    for name in names:
        with np.load(folder / name) as data:
            gram = data["gram"].astype(np.float64) if gram is None else gram + data["gram"]
            total = data["total"].astype(np.float64) if total is None else total + data["total"]
            count += int(data["count"])
    return gram, total, count


def fit_filters(out: Path, model: ModelChoice, calibration: Calibration, bar=None, announce=None) -> tuple[Path, dict]:
    """Collect (or resume) the query sums of `calibration`'s prompts into `out` and write the filters; (weights file,
    provenance with the filters' shape). `bar(total, done)` gives (context manager, advance) for a progress bar; `announce()` is called once
    every input has been checked (so bad input stays one line)."""
    calibration.check()
    out = Path(out)
    record = {"calib_samples": calibration.samples, "target_tokens": calibration.target_tokens, **calibration.record()}
    model, prompts, header = prompt_log.prepare(out, [WEIGHTS, "qfilter.json"], model, record, calibration, {
        "queries": "every position of each prompt (context + probe), after RoPE, per query head"})
    if announce is not None:
        announce()
    with exclusive(out, "qfilter fit"):
        done = prompt_log.collect(out, header, prompts, model, "sums",
                                  lambda loaded, tokenizer, ids, index: prompt_sums(loaded, ids), bar)
        begun = time.perf_counter()
        gram, total, count = summed(out, [d["sums"] for d in done])
        filters, fit = qfilters.filters_from(gram, total, config_shape(model.spec).kv_heads)
        provenance = {**header, "dtype": model.dtype, "positions": count, "prompt_tokens": [d["tokens"] for d in done], **fit,
                      "collect_seconds": round(sum(d["seconds"] for d in done), 1),
                      "fit_seconds": round(time.perf_counter() - begun, 1)}
        path = qfilters.save(out / WEIGHTS, filters, provenance)
    return path, json.loads(path.with_suffix(".json").read_text())  # the provenance with the filters' shape
