"""Measurements a device makes once and keeps in ripplekv's cache folder (`models.cache_root`): one JSON file per
kind, one entry per device and shape. Decoding attention's path (`decode_attention`) and the decoding cost model's
constants (`decode_costs`) are kept this way. A missing, broken or read-only file only costs measuring again."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from ripplekv.engine.models import cache_root


def device_name(device: torch.device) -> str:
    """How an entry names its device: the GPU's model, else the device type and the machine's core count."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} ({os.cpu_count()} cores)"


def kept_or_measured(file: str, entry: str, usable: Callable[[object], bool], measure: Callable[[], dict]) -> dict:
    """`entry`'s measurement kept in `file` when `usable(it)` says it can be used, else `measure()` now, kept there."""
    path = cache_root() / file
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    if usable(known.get(entry)):
        return known[entry]
    known[entry] = measure()
    try:  # a read-only cache folder only costs measuring again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=2) + "\n", encoding="utf-8")
    except OSError:
        pass
    return known[entry]
