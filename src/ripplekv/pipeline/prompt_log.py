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

from ripplekv.errors import UserError
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import UnitLog, atomic_write, other_files
from ripplekv.tasks.calibration import Calibration, calibration_hash

LOG = "samples.jsonl"


def npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def prepare(out: Path, owned: list[str], model: ModelChoice, record: dict, calibration: Calibration,
            described: dict) -> tuple[ModelChoice, list, dict]:
    """(resolved model, calibration prompts, the log's header) once `out` is checked: a fit's own files (`owned`),
    its log and samples/, or nothing. The header: the model, the fit's settings (`record`), the prompts' ids and
    hash, then `described` (what the fit measures), so a resumed fit with other settings or prompts is refused."""
    from ripplekv.engine.models import load_tokenizer, resolve_model

    out = Path(out)
    foreign = [name for name in other_files(out, [LOG, *owned]) if name != "samples"]
    if foreign:
        raise UserError(f"--out {out} holds other files ({', '.join(foreign[:3])}); pass a new or empty directory")
    model = model.resolved()
    source = resolve_model(model.spec)
    prompts = calibration.prompts(load_tokenizer(model.spec))
    header = {"model": source.label, **record, "calibration_ids": [p.sample_id for p in prompts],
              "calibration_hash": calibration_hash(prompts), **described}
    return model, prompts, header


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
