"""Where an eval run's time went, from its timings.csv: seconds and share per phase, over every job the run did.

Each method's build is a row of its own (its scorer's passes and trees included; scores methods share, such
as SnapKV's, count in the first build that computed them); past the `TOP_BUILDS` costliest, the rest are summed
in one row, so the table stays short with many methods.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ripplekv.runs.files import TIMINGS
from ripplekv.runs.timings import UNTIMED, read_timings

TOP_BUILDS = 5
HEADING = "## Where the time went"


def time_table(run_dir: str | Path) -> pd.DataFrame | None:
    """Columns phase, seconds, share (of all recorded seconds), costliest first; None without timings."""
    frame = read_timings(Path(run_dir) / TIMINGS)
    frame = frame[frame["phase"] != UNTIMED]
    if frame.empty or frame["seconds"].sum() <= 0:
        return None
    frame = frame.assign(label=[f"{phase} {method}" if method else phase
                                for phase, method in zip(frame["phase"], frame["method"])])
    spent = frame.groupby("label", sort=False)["seconds"].sum().sort_values(ascending=False, kind="stable")
    per_method = set(frame.loc[frame["method"] != "", "label"])
    builds = [label for label in spent.index if label in per_method]
    rest = builds[TOP_BUILDS:]
    if len(rest) > 1:
        spent = pd.concat([spent.drop(rest), pd.Series({f"build ({len(rest)} other methods)": spent[rest].sum()})])
        spent = spent.sort_values(ascending=False, kind="stable")
    return pd.DataFrame({"phase": spent.index, "seconds": spent.values, "share": spent.values / spent.sum()})


def samples_timed(run_dir: str | Path) -> tuple[int, int]:
    """(samples timed, samples whose lines were written but whose times were lost: `runs.timings.UNTIMED`)."""
    frame = read_timings(Path(run_dir) / TIMINGS)
    frame = frame[frame["sample_id"] != ""]
    timed = frame.loc[frame["phase"] != UNTIMED, ["task", "sample_id"]].drop_duplicates()
    every = frame[["task", "sample_id"]].drop_duplicates()
    return int(timed.shape[0]), int(every.shape[0] - timed.shape[0])


def time_markdown(table: pd.DataFrame, samples: int | tuple[int, int]) -> str:
    """The summary.md section (its last: measured seconds differ between otherwise equal runs)."""
    timed, untimed = samples if isinstance(samples, tuple) else (samples, 0)
    counted = f"the {timed} of {timed + untimed} samples timed" if untimed else f"the {timed} samples timed"
    lost = (f" {untimed} sample{'s were' if untimed > 1 else ' was'} written but not timed (a run stopped between "
            "their lines and their timings row); their seconds are not in the table.") if untimed else ""
    lines = [HEADING, "",
             f"Wall seconds per phase over {counted} in `{TIMINGS}` (every job, resumed runs' "
             f"included) and the reports `eval` rendered; a method's build includes its scorer's passes.{lost}", "",
             "| phase | seconds | share |", "|---|---|---|"]
    lines += [f"| {row.phase} | {row.seconds:.2f} | {100 * row.share:.1f}% |" for row in table.itertuples()]
    return "\n".join([*lines, ""])


def time_rich_table(table: pd.DataFrame, title: str = "where the time went"):
    from rich.table import Table

    out = Table(title=title)
    out.add_column("phase")
    out.add_column("seconds", justify="right")
    out.add_column("share", justify="right")
    for row in table.itertuples():
        out.add_row(row.phase, f"{row.seconds:.2f}", f"{100 * row.share:.1f}%")
    return out
