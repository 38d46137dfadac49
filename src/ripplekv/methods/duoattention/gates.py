"""DuoAttention's fitted gates: one JSON file per model (`ripplekv fit duoattention` writes it).

The file holds each (layer, KV head)'s gate alpha in [0, 1] (high: a retrieval head), the streaming window the
gates were fitted with (`sinks`, `recent`: a streaming head keeps the first `sinks` and the last `recent`
entries) and the fit's provenance. The method reads the window from the file, since the gates mean something
only for the window they were trained against (kvpress reads `sink_size` and `recent_size` from the published
pattern's config the same way).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ripplekv
from ripplekv.errors import UserError
from ripplekv.methods.core import fitted_weights

FORMAT = "ripplekv-duoattention-gates"
SHIPPED = Path(ripplekv.__file__).resolve().parent / "data" / "duoattention"
FIT_HINT = ("fit them on calibration prompts: ripplekv fit duoattention --model M --out DIR, then pass "
            "duoattention:gates=DIR/duoattention-gates.json")


def shipped_gates() -> Path:
    """The bundled model's fitted gates (missing in a checkout that never shipped them)."""
    from ripplekv.engine.models import DEFAULT_MODEL

    return SHIPPED / f"{DEFAULT_MODEL}.json"


def gates_text(gates: list[list[float]], sinks: int, recent: int, provenance: dict) -> str:
    """A gates file's contents (`pipeline.duoattention_fit` writes them atomically after every step)."""
    body = {"format": FORMAT, "sinks": int(sinks), "recent": int(recent),
            "gates": [[round(float(g), 6) for g in row] for row in gates], "provenance": provenance}
    return json.dumps(body, indent=1) + "\n"


def write_gates(path: Path, gates: list[list[float]], sinks: int, recent: int, provenance: dict) -> Path:
    """A gates file at `path` (given gates: a test's, or another tool's)."""
    Path(path).write_text(gates_text(gates, sinks, recent, provenance))
    return Path(path)


def read_gates(path: str | Path) -> dict:
    """{"gates": [L][H] floats, "sinks", "recent", "provenance"} of a gates file, loaded once per file version;
    every problem is one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"DuoAttention gates {path} do not exist; {FIT_HINT}")
    return fitted_weights.loaded_once(path, _parse)


def _parse(path: Path) -> dict:
    try:
        body = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"DuoAttention gates {path} are not readable JSON ({str(err).splitlines()[0]}); {FIT_HINT}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise UserError(f"DuoAttention gates {path} were not written by ripplekv fit duoattention; {FIT_HINT}")
    gates, sinks, recent = body.get("gates"), body.get("sinks"), body.get("recent")
    rows_ok = isinstance(gates, list) and gates and all(isinstance(r, list) and r and len(r) == len(gates[0]) for r in gates)
    values = [g for row in gates for g in row] if rows_ok else []
    if not rows_ok or not all(isinstance(g, (int, float)) and math.isfinite(g) and 0 <= g <= 1 for g in values):
        raise UserError(f"DuoAttention gates {path}: gates must be a [layers][KV heads] table of numbers in [0, 1]")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (sinks, recent)) or sinks + recent < 1:
        raise UserError(f"DuoAttention gates {path}: sinks and recent must be non-negative integers, not both 0")
    return {"gates": gates, "sinks": sinks, "recent": recent, "provenance": body.get("provenance", {})}


def gates_path(given: str | None, state, bundled: bool | None) -> Path:
    """The gates given, or the shipped ones for the bundled model; any other model is one line naming the fit."""
    return fitted_weights.given_or_shipped(given, shipped_gates(), state, bundled,
                                           f"duoattention needs gates fitted for this model; {FIT_HINT}")


def check_shape(path: Path, gates: list, layers: int, heads: int) -> None:
    fitted_weights.check_shape("DuoAttention gates", path, (len(gates), len(gates[0])), (layers, heads), FIT_HINT)
