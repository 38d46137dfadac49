"""How well does a cheap signal predict DepthKV's measured sensitivity (the task-score drop)?

For each signal profile (RippleKV's noise KL, the eviction KL, InfoNCE), the Spearman rank correlation
across layers between its per-layer mean and the per-layer mean drop, with a bootstrap interval over
calibration samples. When the two profiles share samples, only the shared ones are used and they are
resampled together (paired); otherwise each profile's samples are resampled on their own. InfoNCE enters
with its sign turned (a lower loss is a higher mutual-information bound, which the allocation reads as
the more sensitive layer), so a positive rho always means "the signal ranks layers as the drop does".
A resample in which either side is constant over layers has no rank correlation and is left out.
A profile may be several folders, one per calibration draw (`a,b,c`): their samples are pooled into one profile,
so the correlation rests on the union of the draws' prompts.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from ripplekv.analysis.stats import CONFIDENCE, RESAMPLES, SEED, interval
from ripplekv.errors import UserError

VALUE_COLUMNS = ("kl", "drop", "infonce")
ORIENTATION = {"infonce": -1.0}  # a lower InfoNCE loss marks the layer the allocation treats as more sensitive


@dataclass
class LayerProfile:
    """Per-sample, per-layer values of one profile (seeds averaged), oriented so higher = more sensitive."""

    name: str
    sample_ids: list[str]
    values: np.ndarray  # [samples, layers]


def read_layer_profile(folders: str | Path | list) -> LayerProfile:
    """A profile folder's per_sample.csv (and profile.json for its name), as a `LayerProfile`; several folders
    (a list, or one string joining them with commas: a profile's calibration draws) pool their samples, which must
    be of one signal and share no sample."""
    parts = [p for p in str(folders).split(",") if p.strip()] if isinstance(folders, (str, Path)) else list(folders)
    profiles = [_read_one(part) for part in parts]
    if not profiles:
        raise UserError("no profile folder given")
    first = profiles[0]
    for other, part in zip(profiles[1:], parts[1:]):
        if other.name != first.name or other.values.shape[1] != first.values.shape[1]:
            raise UserError(f"{part} is a {other.name} profile of {other.values.shape[1]} layers, {parts[0]} a "
                            f"{first.name} one of {first.values.shape[1]}: pool only draws of one profile")
    ids = [sid for profile in profiles for sid in profile.sample_ids]
    if len(set(ids)) < len(ids):
        raise UserError(f"the profiles {', '.join(map(str, parts))} share calibration samples; pool disjoint draws only")
    return LayerProfile(first.name, ids, np.concatenate([profile.values for profile in profiles]))


def _read_one(folder: str | Path) -> LayerProfile:
    folder = Path(folder)
    table_path, meta_path = folder / "per_sample.csv", folder / "profile.json"
    if not table_path.is_file() or not meta_path.is_file():
        raise UserError(f"{folder} is not a finished profile (no per_sample.csv / profile.json); run `ripplekv profile`")
    table = pd.read_csv(table_path)
    column = next((c for c in VALUE_COLUMNS if c in table.columns), None)
    if column is None:
        raise UserError(f"{table_path} has none of the columns {', '.join(VALUE_COLUMNS)}")
    meta = json.loads(meta_path.read_text())
    name = meta.get("signal", "?") + (f" ({meta['measure']})" if meta.get("measure") else "")
    if meta.get("signal") == "evict" and not meta.get("measure"):
        name = "evict (kl)"
    wide = table.groupby(["sample_id", "layer"])[column].mean().unstack("layer")
    ids = [sid for sid in meta.get("calibration_ids", wide.index) if sid in wide.index]
    return LayerProfile(name, ids, ORIENTATION.get(column, 1.0) * wide.loc[ids].to_numpy(dtype=float))


def _rho(a: np.ndarray, b: np.ndarray) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(spearmanr(a, b).statistic)


def rank_agreement(signal: LayerProfile, drop: LayerProfile, resamples: int = RESAMPLES, seed: int = SEED,
                   confidence: float = CONFIDENCE) -> dict:
    """Spearman rho across layers between the mean signal and the mean drop, with a bootstrap interval."""
    if signal.values.shape[1] != drop.values.shape[1]:
        raise UserError(f"{signal.name} has {signal.values.shape[1]} layers, the drop {drop.values.shape[1]}: "
                        "profile the same model")
    shared = [sid for sid in drop.sample_ids if sid in set(signal.sample_ids)]
    if shared:
        a = signal.values[[signal.sample_ids.index(s) for s in shared]]
        b = drop.values[[drop.sample_ids.index(s) for s in shared]]
    else:
        a, b = signal.values, drop.values
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        first = rng.integers(0, len(a), size=len(a))
        second = first if shared else rng.integers(0, len(b), size=len(b))
        draws.append(_rho(a[first].mean(0), b[second].mean(0)))
    draws = np.asarray(draws)
    kept = draws[np.isfinite(draws)]
    low, high = interval(kept, confidence) if kept.size else (np.nan, np.nan)
    return {"signal": signal.name, "samples_signal": len(a), "samples_drop": len(b), "paired": bool(shared),
            "spearman": _rho(a.mean(0), b.mean(0)), "low": float(low), "high": float(high),
            "resamples_used": int(kept.size), "confidence": confidence}


def predictor_table(drop_folder: str | Path, signal_folders: list[str | Path], **options) -> pd.DataFrame:
    """One row per signal profile: how well it ranks layers as the measured drop does."""
    drop = read_layer_profile(drop_folder)
    if "drop" not in drop.name:
        raise UserError(f"{drop_folder} is not a task-drop profile (profile --signal evict --measure task-drop)")
    rows = [{**rank_agreement(read_layer_profile(folder), drop, **options),
             "profile": ",".join(str(part) for part in (folder if isinstance(folder, list) else [folder]))}
            for folder in signal_folders]
    return pd.DataFrame(rows)
