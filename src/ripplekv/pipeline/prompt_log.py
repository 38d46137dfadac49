"""A fit's per-prompt measurements on calibration prompts, resumable: each prompt's arrays in `samples/ID.npz` and one
line of the fit's log as soon as they are done, so a killed fit goes on where it stopped and other settings are
refused (`runs.safeio.UnitLog`). KVzap's (and FastKVzip's) training pairs and Q-Filters' query sums are kept so.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import UnitLog, atomic_write

LOG = "samples.jsonl"


def npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def collect(out: Path, header: dict, prompts, model: ModelChoice, field: str,
            measure: Callable[[object, object, list[int], int], dict[str, np.ndarray]], bar=None) -> list[dict]:
    """`measure(model, tokenizer, ids, index)` of each prompt not yet in `out`/LOG, its file named under `field` in
    the log's entry (with its tokens and seconds); the log's entries in prompt order. The caller holds the fit's
    lock. `bar(total, done)` gives (context manager, advance)."""
    log = UnitLog(out / LOG, header, remedy="use a new --out directory")
    todo = [(i, p) for i, p in enumerate(prompts) if p.sample_id not in log.done]
    if todo:
        loaded, tokenizer, _ = model.load()
        context, advance = bar(len(prompts), len(prompts) - len(todo)) if bar else (nullcontext(), None)
        with context:
            for index, prompt in todo:
                begun = time.perf_counter()
                ids = prompt.context + prompt.probe
                data = npz_bytes(**measure(loaded, tokenizer, ids, index))
                name = f"samples/{prompt.sample_id}.npz"
                atomic_write(out / name, lambda tmp, data=data: tmp.write_bytes(data))
                log.append(prompt.sample_id, {field: name, "tokens": len(ids),
                                              "seconds": round(time.perf_counter() - begun, 2)})
                if advance is not None:
                    advance(index)
    return [log.done[p.sample_id] for p in prompts]
