"""Calibration draws in an eval: each calibrated method of a --methods list, once more per further draw.

A calibrated method is one that reads a calibration output through a file option (`allocation=`, `route=`,
`profile=`: RippleKV's and DepthKV's allocations, a route, CompressKV's profile), named in its spec or given to
the whole eval (`--allocation`, `--route`). Draw d >= 1 of a calibration output `DIR/NAME.csv` is
`DIR/draws/dD/NAME-dD.csv` for outputs in DIR itself, and `DIR/draws/dD/ROUTE-dD.csv` for a route
(`DIR/route/ROUTE.csv`): a label shows a file's name only, so every draw's file has a name of its own. A
method becomes one variant per draw whose files all exist, with those files named explicitly; the table of
(method, draw, variant) labels says which eval lines belong to which draw (`analysis.draws` reads it).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ripplekv.errors import UserError

FILE_KEYS = ("allocation", "route", "profile")  # the file options a calibrated method reads (methods.FILE_OPTIONS)
TABLE_COLUMNS = ["method", "draw", "variant"]


def draw_file(path: str | Path, root: str | Path, draw: int) -> Path:
    """Where draw `draw` keeps its counterpart of calibration output `path` (an output of the run in `root`)."""
    path, root = Path(path), Path(root)
    folder = root / "draws" / f"d{draw}"
    return folder / f"{path.stem}-d{draw}{path.suffix}"


def _uses(entry: str, shared: dict[str, str | None]) -> dict[str, str]:
    """The calibration files a --methods entry reads: its own file options, and the eval's shared ones it takes."""
    from ripplekv.methods import parse_spec
    from ripplekv.methods.core.spec import options_taken

    _, options = parse_spec(entry)
    used = {key: value for key, value in options.items() if key in FILE_KEYS}
    taken = options_taken([entry])
    for key, value in shared.items():
        if value and key in taken and key not in used:
            used[key] = value
    return used


def _with(entry: str, files: dict[str, str]) -> str:
    from ripplekv.methods import parse_spec

    name, options = parse_spec(entry)
    options.update(files)
    return name + "".join(f":{key}={options[key]}" for key in sorted(options))


def draw_variants(methods: str, root: str | Path, draws: int, shared: dict[str, str | None]) -> tuple[list[str], pd.DataFrame]:
    """(the extra --methods entries of draws 1 .. draws-1, the (method, draw, variant) table including draw 0).

    `shared`: the eval's --allocation / --route. A method whose files lack a draw's counterpart has no variant for
    that draw (its stage did not run for it); one that reads no calibration file has none at all."""
    from ripplekv.methods import make_method

    if draws < 1:
        raise UserError(f"draws must be at least 1, got {draws}")
    extra, rows = [], []
    options = {key: value for key, value in shared.items() if value}
    for entry in (part.strip() for part in methods.split(",") if part.strip()):
        used = _uses(entry, shared)
        if not used:
            continue
        label = make_method(entry, shared=options).label
        rows.append({"method": label, "draw": 0, "variant": label})
        for draw in range(1, draws):
            files = {key: str(draw_file(value, root, draw)) for key, value in used.items()}
            if not all(Path(value).is_file() for value in files.values()):
                continue
            spec = _with(entry, files)
            extra.append(spec)
            rows.append({"method": label, "draw": draw, "variant": make_method(spec, shared=options).label})
    return extra, pd.DataFrame(rows, columns=TABLE_COLUMNS)


def write_spread(out: Path) -> None:
    """Each calibrated method's spread across draws (OUT/calibration_spread.csv and _per_draw.csv), from draw 0's eval
    (OUT/eval), the further draws' (OUT/eval-draws) and OUT/draws.csv; only samples every draw ran are compared."""
    from ripplekv.analysis.calibration_spread import spread, spread_markdown
    from ripplekv.analysis.report import load_predictions
    from ripplekv.runs.safeio import write_csv

    first, further = load_predictions(out / "eval"), load_predictions(out / "eval-draws")
    frame = pd.concat([first, further[~further["method"].isin(set(first["method"]))]], ignore_index=True)
    summary, per_draw = spread(frame, pd.read_csv(out / "draws.csv"))
    write_csv(out / "calibration_spread.csv", summary, float_format="%.6g")
    write_csv(out / "calibration_spread_per_draw.csv", per_draw, float_format="%.6g")
    print(spread_markdown(summary) if not summary.empty else "no method ran on two or more draws")
