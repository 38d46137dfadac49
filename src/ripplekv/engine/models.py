"""Load a model and tokenizer from a hub id, a local directory, a `.gguf` file, or the bundled default.

The bundled default (SmolLM2-135M-Instruct) and Gemma 3 270M (`--model gemma3-270m`) come as GGUF files
in packages `make install` installs (`engine.packaged`). Dequantizing a GGUF takes ~17 s (~100 s for Gemma), so the dequantized weights are cached on disk as a plain
transformers directory (safetensors) and later loads read that instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

from ripplekv.defaults import DTYPES
from ripplekv.engine.packaged import (  # noqa: F401 - the packaged models' names, found here as before
    BUNDLED_GGUF_NAME,
    BUNDLED_GGUF_PACKAGE,
    DEFAULT_MODEL,
    GEMMA3_270M,
    bundled_gguf_path,
    gemma3_gguf_path,
    installed_package_dir,
    names_bundled,
)
from ripplekv.errors import Notice, UserError, write_failure

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `kind` is 'gguf', 'local' or 'hub'."""

    kind: str
    location: str
    label: str


def cache_root() -> Path:
    """Where ripplekv keeps dequantized models: $RIPPLEKV_CACHE, else ~/.cache/ripplekv."""
    return Path(os.environ.get("RIPPLEKV_CACHE", Path.home() / ".cache" / "ripplekv"))


def resolve_model(spec: str | os.PathLike | None) -> ModelSource:
    """Decide what kind of model `spec` (text or a path) names; a wrong path fails here with one line saying what
    it is instead (absent, a plain file); a folder is a model directory whatever its name ends in."""
    spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if spec is not None and not isinstance(spec, str):
        raise UserError(f"{{model}} must be a hub id, a model directory or a .gguf file, not {type(spec).__name__}", "model")
    if names_bundled(spec):
        return ModelSource("gguf", str(bundled_gguf_path()), DEFAULT_MODEL)
    if spec == GEMMA3_270M:
        return ModelSource("gguf", str(gemma3_gguf_path()), GEMMA3_270M)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") and not path.is_dir():
        if not path.is_file():
            raise UserError(f"model file {spec} does not exist; pass an existing .gguf file")
        _check_gguf(path)
        return ModelSource("gguf", str(path.resolve()), path.name)
    if path.exists() or spec.startswith((".", "/", "~")):
        what = "does not exist" if not path.exists() else "is a file, not a model directory" if path.is_file() else None
        if what or not (path / "config.json").is_file():
            raise UserError(f"model directory {spec} {what or 'has no config.json'}; pass a transformers model "
                            "directory (with config.json), a .gguf file or a hub id")
        _check_config_json(path / "config.json")
        return ModelSource("local", str(path.resolve()), path.name)
    return ModelSource("hub", spec, spec)


def model_fingerprint(source: ModelSource) -> str | None:
    """What identifies a model's weights wherever its files lie (a run is grown only by the same model):
    a GGUF file's SHA-256; for a model directory, SHA-256 over config.json and each weight file's name,
    size, first and last MiB (hashing every byte of a multi-GB checkpoint would cost seconds per command);
    None for a hub id (its name is its identity)."""
    if source.kind == "hub":
        return None
    if source.kind == "gguf":
        return file_sha256(source.location)
    digest = hashlib.sha256()
    folder = Path(source.location)
    digest.update((folder / "config.json").read_bytes())
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()


def _check_gguf(path: Path) -> None:
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as err:
        raise UserError(f"model file {path} cannot be read ({err.strerror}); pass a readable .gguf file") from None
    if magic != b"GGUF":
        raise UserError(f"model file {path} is not a GGUF file (it does not start with 'GGUF'); "
                        "pass a real .gguf model file")


def _check_config_json(path: Path) -> None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is not a readable JSON file ({type(err).__name__}); "
                        "restore the model directory's config.json") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{path} is not a transformers model config (no 'model_type'); "
                        "restore the model directory's config.json")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_files(spec: str | None, weights: bool = True) -> None:
    """A local model directory must hold a tokenizer (and weights): say so before any work starts."""
    source = resolve_model(spec)
    if source.kind != "local":
        return
    folder = Path(source.location)
    wanted = [("tokenizer", TOKENIZER_FILES)] + ([("weights", WEIGHT_FILES)] if weights else [])
    for what, names in wanted:
        if not any((folder / name).is_file() for name in names):
            raise UserError(f"model directory {folder} has no {what} (none of {', '.join(names)}); "
                            "pass a complete transformers model directory")


def file_sha256(path: str | Path) -> str:
    """A file's SHA-256 (~0.1 s for the bundled 98 MB GGUF), computed once per process for each version of it."""
    stat = Path(path).stat()
    return _sha256_of(str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int) -> str:  # a replaced or rewritten file: hashed again
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _gguf_cache_dir(gguf_path: str) -> Path:
    """Keyed on the file's content, not its path or mtime: a fresh clone's venv installs the same bundled GGUF
    with a new path and time, and reuses the weights dequantized from it before (~20 s saved per clone)."""
    return cache_root() / "models" / f"{Path(gguf_path).stem}-{file_sha256(gguf_path)[:16]}"


def _check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def hub_offline() -> bool:
    """Whether the user switched the hub off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("HF_DATASETS_OFFLINE", ""))
    return any(flag.lower() in ("1", "true", "yes", "on") for flag in flags)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One connection attempt to the hub (or a proxy is set): without it, a download retries for ~25 s."""
    from urllib.parse import urlparse

    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub_or_local(cls, location: str, source: ModelSource, **kwargs):
    """Load from a directory, or the hub cache first and the network second (if reachable: a mistyped id fails fast)."""
    if source.kind != "hub":
        try:
            return cls.from_pretrained(location, **kwargs)
        except UserError:
            raise
        except Exception as err:  # a broken file the user gave us: name it instead of a loader traceback
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise UserError(f"cannot load {cls.__name__.removeprefix('Auto')} from {source.location} "
                            f"({type(err).__name__}: {first}); check or replace the model files") from None
    try:
        return cls.from_pretrained(location, local_files_only=True, **kwargs)
    except OSError:
        pass
    if hub_offline() or not hub_reachable():
        why = "the hub is switched off (HF_HUB_OFFLINE)" if hub_offline() else "the hub cannot be reached"
        raise UserError(f"model {location!r} is not in the local hub cache and {why}; check the id, "
                        "or pass a local model directory or .gguf file as {model}", "model")
    try:
        return cls.from_pretrained(location, **kwargs)
    except OSError as err:
        raise UserError(
            f"model {location!r} is not in the local hub cache and could not be downloaded ({type(err).__name__}); "
            "pass a local model directory or .gguf file as {model}", "model"
        ) from None


def _save_plain(model, folder: Path) -> None:
    """Write dequantized weights as safetensors (transformers refuses to save a GGUF-loaded model)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in tied}
    try:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    except Exception as err:  # safetensors reports a failed write as its own error, with the OS's code inside
        import re

        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(folder / "model.safetensors")) from None
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)


def _materialize_gguf(source: ModelSource) -> Path:
    """Dequantize a GGUF once into a transformers directory; later loads read the directory.

    Processes on one host (two commands, Ray workers) share the cache: a file lock makes the first one
    write it while the others wait, then read what it wrote."""
    from filelock import FileLock

    target = _gguf_cache_dir(source.location)
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if (target / "config.json").is_file() and (target / ".complete").is_file():
                return target  # another process wrote it while we waited
            return _dequantize(source, target)
    except OSError as err:  # a full or read-only cache: nothing half-written is left as if complete
        import shutil

        shutil.rmtree(target.with_name(target.name + ".partial"), ignore_errors=True)
        raise write_failure(getattr(err, "filename", None) or target, err, then="rerun the command",
                            elsewhere="set RIPPLEKV_CACHE to a folder with room for the dequantized model") from None


def _dequantize(source: ModelSource, target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    warnings.warn(Notice(f"dequantizing {Path(source.location).name} once into {target} (20-100 s)"), stacklevel=2)
    folder, name = os.path.dirname(source.location), os.path.basename(source.location)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # truncated or foreign GGUF: a user's file, not our bug
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"cannot read the GGUF model {source.location} ({type(err).__name__}: {first}); "
                        "pass a complete GGUF file of a supported model") from None
    _check_supported(model.config)
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    _save_plain(model, tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(source.location + "\n")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _quiet_transformers() -> None:
    """Our commands draw their own progress; transformers' per-load bars and notices would interleave."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _source_and_location(spec: str | None) -> tuple[ModelSource, str]:
    """What `spec` names, and where transformers can load it from (a dequantized GGUF is cached once)."""
    source = resolve_model(spec)
    location = str(_materialize_gguf(source)) if source.kind == "gguf" else source.location
    return source, location


def load_config(spec: str | None = None):
    """The model config alone (checked for a supported architecture)."""
    from transformers import AutoConfig

    source, location = _source_and_location(spec)
    config = _from_hub_or_local(AutoConfig, location, source)
    _check_supported(config)
    return config


_TOKENIZERS: dict[str, object] = {}  # by location: read once per process


def _tokenizer_at(location: str, source: ModelSource):
    """The tokenizer at `location`, read once per process: eval reads it to check its input before the model
    loads, and loading the model would read it again (0.12 s for the bundled one). Nothing of ours changes a
    tokenizer after loading, so one object serves every caller."""
    from transformers import AutoTokenizer

    if location not in _TOKENIZERS:
        _TOKENIZERS[location] = _from_hub_or_local(AutoTokenizer, location, source)
    return _TOKENIZERS[location]


def load_tokenizer(spec: str | None = None):
    """The tokenizer alone (fast: no weights)."""
    check_model_files(spec, weights=False)
    source, location = _source_and_location(spec)
    return _tokenizer_at(location, source)


DEVICES_HELP = "auto (CUDA when a GPU is there, else CPU), cpu, cuda or cuda:N"


def resolve_device_dtype(device: str | None = "auto", dtype: str | None = "auto") -> tuple[str, str]:
    """Concrete (device, dtype): auto is CUDA + bfloat16 when a GPU is there, else CPU + float32."""
    import torch

    device = (device or "auto").strip().lower()
    dtype = (dtype or "auto").strip().lower()
    if dtype not in DTYPES:
        raise UserError(f"{{dtype}} must be one of {', '.join(DTYPES)}, got {dtype!r}", "dtype")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise UserError(f"{{device}} must be {DEVICES_HELP}; got {device!r}", "device")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"{{device}} {device} asked for a GPU, but torch sees no CUDA device; use {{device}} cpu",
                            "device")
        index = int(device[5:]) if device.startswith("cuda:") else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"{{device}} {device}: only {torch.cuda.device_count()} CUDA device(s) are visible",
                            "device")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def runtime_info(device: str) -> dict:
    """What a result depends on besides the settings: versions, attention path, the device's name."""
    import torch
    import transformers

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {
        "attention": "prefill: sdpa; compressed decode: ripplekv attention (float32 softmax)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device_name": name,
    }


def load_model(spec: str | None = None, device: str | None = "auto", dtype: str | None = "auto"):
    """Return `(model, tokenizer, source)` in eval mode on `device` in `dtype` (see `resolve_device_dtype`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ripplekv.engine import adapter

    device, dtype = resolve_device_dtype(device, dtype)
    _quiet_transformers()
    check_model_files(spec)
    source, location = _source_and_location(spec)
    config = _from_hub_or_local(AutoConfig, location, source)
    _check_supported(config)  # before any weights are read
    adapter.check_supported(config)
    model = _from_hub_or_local(AutoModelForCausalLM, location, source, dtype=getattr(torch, dtype))
    tokenizer = _tokenizer_at(location, source)
    model.to(device)
    model.eval()
    return model, tokenizer, source


def is_bundled(model) -> bool:
    """Whether a loaded model is the bundled SmolLM2 (so the allocation shipped for it applies)."""
    try:
        bundled = _gguf_cache_dir(str(bundled_gguf_path()))
    except (UserError, OSError):
        return False
    name = str(getattr(model.config, "_name_or_path", "") or "")
    return bool(name) and Path(name).resolve() == bundled.resolve()
