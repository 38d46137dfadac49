"""check-references' Q-Filters pair: kvpress's `QFilterPress` given the filters we fitted for the bundled model.

`QFilterPress.post_init_from_model` would download filters trained for a few larger models from the hub; here its
`q_filters` field is set to ours (`src/ripplekv/data/qfilter/`), copied into the run folder for the worker (which
imports no ripplekv), and its own `compress` chooses, as for KVzap's surrogate. Without shipped filters the pair is
left out with one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# check name -> (our spec reproducing the press: kvpress keeps no window, the worker's press key)
QFILTER_PAIRS = {"qfilter": ("qfilter:window=0", "qfilter")}
FILE = "qfilter.safetensors"


def shipped_filters(out: Path) -> list[str]:
    """The check names whose filters ship for the bundled model, copied into `out` for the worker."""
    from ripplekv.methods.qfilter.method import shipped_filters as shipped

    path = shipped()
    if not path.is_file():
        return []
    shutil.copyfile(path, out / FILE)
    return list(QFILTER_PAIRS)


def missing_line(found: list[str]) -> list[str]:
    return [] if found else ["qfilter: no Q-filters shipped for the bundled model (src/ripplekv/data/qfilter/), so "
                             "QFilterPress is not checked"]


def qfilter_presses(out: Path) -> dict:
    """(worker side, reference venv) worker key -> `QFilterPress` holding our filters from `out`, never the hub's."""
    from kvpress import QFilterPress
    from safetensors.torch import load_file

    if not (out / FILE).is_file():
        return {}
    press = QFilterPress()
    press.q_filters = load_file(str(out / FILE))["q_filters"].float()  # the field its post_init_from_model fills
    return {key: press for _, key in QFILTER_PAIRS.values()}
