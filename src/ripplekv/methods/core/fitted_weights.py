"""Weights fitted here on calibration prompts, on disk: a safetensors file beside a JSON sidecar (`FILE.json`) with
the shapes and the provenance. KVzap's surrogates, FastKVzip's gates and Q-Filters' filters are stored this way, both written whole (a
kill leaves the old file or the new one) and read back with every problem as one line naming the file and the fit
command that makes it again."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ripplekv.errors import UserError

_LOADED: dict = {}


def save(path: str | Path, tensors: dict[str, torch.Tensor], sidecar: dict) -> Path:
    """`tensors` (as given: the caller picks the dtype) at `path` and `sidecar` at `path`.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    save_file({name: value.detach().contiguous() for name, value in tensors.items()}, str(temporary))
    temporary.replace(path)
    side = path.with_suffix(".json")
    temporary = side.with_name(f".{side.name}.tmp")
    temporary.write_text(json.dumps(sidecar, indent=2) + "\n")
    temporary.replace(side)
    return path


def load(path: str | Path, what: str, fit: str, build: Callable[[dict, dict], object], hint: str | None = None):
    """(build(sidecar, float32 tensors), sidecar) of a weights file; `what` names it in a refusal ("KVzap weights")
    and `fit` is the fit command's hint ("ripplekv fit kvzap --out DIR, then pass kvzap:weights=FILE"); `hint`, when
    given, is the whole advice both refusals end with instead."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    side = path.with_suffix(".json")
    if not path.is_file() or not side.is_file():
        raise UserError(f"{what} {path} (and {side.name} beside them) do not exist; {hint or f'fit them with {fit}'}")
    try:
        info = json.loads(side.read_text())
        built = build(info, {name: value.float() for name, value in load_file(str(path)).items()})
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise UserError(f"{what} {path} do not load ({str(err).splitlines()[0][:200]}); "
                        f"{hint or f'fit them again with {fit}'}") from None
    return built, info


def loaded_once(path: Path, read: Callable[[Path], object]):
    """`read(path)`, kept per loader and file version (path and modification time): a method asks for its fitted
    file at every layer of every prompt; a file rewritten by a refit is read again."""
    key = (read, str(path.resolve()), path.stat().st_mtime_ns if path.is_file() else 0)
    if key not in _LOADED:
        _LOADED[key] = read(path)
    return _LOADED[key]


def given_or_shipped(given: str | None, shipped: Path, state, bundled: bool | None, refusal: str) -> Path:
    """The file a method was given, else the one shipped for the bundled model (`bundled`: whether the model is it;
    None: asked of `state`'s model); any other model is the one line `refusal`."""
    if given is not None:
        return Path(given)
    if bundled is None:
        from ripplekv.engine.models import is_bundled

        bundled = getattr(state, "model", None) is not None and is_bundled(state.model)
    if not (bundled and shipped.is_file()):
        raise UserError(refusal)
    return shipped


def check_shape(what: str, path, fitted: Sequence[int], model: Sequence[int], hint: str,
                names: Sequence[str] = ("layers", "KV heads", "hidden size")) -> None:
    """One refusal, worded alike for every fitted file, when it was made for another model's shape: the dimensions
    it was fitted for against the model's, each named (`names`, as many as given)."""
    if tuple(fitted) != tuple(model):
        said = lambda dims: " x ".join(f"{size} {name}" for size, name in zip(dims, names))  # noqa: E731
        raise UserError(f"{what} {path} was fitted for {said(fitted)}; the model has {said(model)}; {hint}")
