"""Per-phase timings: every eval sample's phases in timings.csv, kept once across resumes, and `report`'s
"where the time went"."""

from __future__ import annotations

import json
import shutil
import time

import pandas as pd
import pytest

from ripplekv.analysis import time_spent
from ripplekv.engine import timings
from ripplekv.runs.timings import COLUMNS, TimingsLog, read_timings
from tests.conftest import invoke

TASKS = ("niah", "squad")
# h2o and expected-attention bring the prefill's two attention recorders beside the window queries
METHODS = ("full", "snapkv", "h2o", "expected-attention", "streamingllm")
RECORDERS = ("window_queries", "accumulated_attention", "query_statistics")
SHARED = (timings.PREFILL, timings.REFERENCE_DECODE, timings.TEACHER_FORCED, timings.DIVERGENCE_DECODE, timings.OTHER)


def eval_args(model, out, methods=METHODS):
    return ["eval", "--model", str(model), "--suite", "offline", "--tasks", ",".join(TASKS), "--limit", "1",
            "--target-tokens", "300", "--methods", ",".join(methods), "--budget", "32", "--batch-size", "4",
            "--out", str(out)]


@pytest.fixture(scope="module")
def timed_run(tiny_model_dir, tmp_path_factory):
    """One eval run (shared: the tests below copy it before changing it), its wall time and what it printed."""
    out = tmp_path_factory.mktemp("timed") / "run"
    start = time.perf_counter()
    result = invoke(*eval_args(tiny_model_dir, out))
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    return out, wall, result.stdout


def sample_rows(out):
    frame = read_timings(out / "timings.csv")
    return frame[frame["sample_id"] != ""]


def samples_of(out) -> list[tuple[str, str]]:
    config = json.loads((out / "config.json").read_text())
    return [(task, sid) for task, ids in config["samples"].items() for sid in ids]


@pytest.mark.slow
def test_every_sample_times_every_phase_within_the_run_wall_time(timed_run):
    out, wall, _ = timed_run
    frame = read_timings(out / "timings.csv")
    assert list(frame.columns) == list(COLUMNS) and (frame["seconds"] >= 0).all()
    expected = {(phase, "") for phase in SHARED} | {(timings.RECORDER + name, "") for name in RECORDERS}
    expected |= {(timings.BUILD, method) for method in METHODS if method != "full"}
    for task, sid in samples_of(out):
        rows = frame[(frame["task"] == task) & (frame["sample_id"] == sid)]
        assert set(zip(rows["phase"], rows["method"])) == expected, (task, sid)
        assert (rows["job"] == 1).all() and len(rows) == len(expected)  # each phase once: a sample's sum is its time
        assert rows.loc[rows["phase"] == timings.PREFILL, "seconds"].iloc[0] > 0
    assert sample_rows(out).groupby(["task", "sample_id"])["seconds"].sum().max() <= wall
    assert frame["seconds"].sum() <= wall  # phases never overlap: nested ones count once
    report = frame[frame["sample_id"] == ""]
    assert report["phase"].tolist() == [timings.REPORT] and report["seconds"].iloc[0] > 0


@pytest.mark.slow
def test_a_resumed_run_keeps_its_rows_and_times_new_work_once(timed_run, tiny_model_dir, tmp_path, run_cli):
    out = shutil.copytree(timed_run[0], tmp_path / "run")
    first = sample_rows(out)
    assert run_cli(*eval_args(tiny_model_dir, out))[0] == 0  # nothing to do: only the report is timed again
    pd.testing.assert_frame_equal(sample_rows(out), first)
    with (out / "timings.csv").open("ab") as fh:  # a kill mid-write leaves a torn row; the next run cuts it
        fh.write(b"squad,squad-x,1,pre")
    code, _, err = run_cli(*eval_args(tiny_model_dir, out, (*METHODS, "random")))
    assert code == 0, err
    grown = sample_rows(out)
    keys = ["task", "sample_id", "job", "phase", "method"]
    assert not grown.duplicated(keys).any() and "squad-x" not in set(grown["sample_id"])
    pd.testing.assert_frame_equal(grown.iloc[: len(first)].reset_index(drop=True), first.reset_index(drop=True))
    again = grown.iloc[len(first):]  # the new method's variants: every sample prefilled again, its second job
    assert set(zip(again["task"], again["sample_id"])) == set(samples_of(out)) and (again["job"] == 2).all()
    assert set(again.loc[again["phase"] == timings.BUILD, "method"]) == {"random"}
    assert len(read_timings(out / "timings.csv").query("phase == 'report'")) == 3


@pytest.mark.slow
def test_report_prints_where_the_time_went(timed_run, tmp_path, run_cli):
    assert "where the time went" in timed_run[2]
    out = shutil.copytree(timed_run[0], tmp_path / "run")
    code, printed, err = run_cli("report", str(out))
    assert code == 0, err
    assert "where the time went" in printed and "prefill" in printed
    summary = (out / "summary.md").read_text()
    assert time_spent.HEADING in summary and "| prefill |" in summary
    assert summary.rstrip().endswith("|")  # the last section: run_files (conftest) cuts it when comparing runs


def test_nested_phases_keep_their_own_time_and_builds_beyond_the_top_are_summed(tmp_path, monkeypatch):
    now = [0.0]  # a clock the test advances: sleeping would make the sums depend on the machine's load
    monkeypatch.setattr(timings, "perf_counter", lambda: now[0])

    def spend(seconds: float) -> None:
        now[0] += seconds

    with timings.collect() as spent:
        spend(0.01)
        with timings.phase("outer"):
            spend(0.02)
            with timings.phase(timings.BUILD, "a"):
                spend(0.03)
    seconds = {(phase, method): value for phase, method, value in spent.rows()}
    assert seconds[("outer", "")] == pytest.approx(0.02)
    assert seconds[(timings.BUILD, "a")] == pytest.approx(0.03)
    assert seconds[(timings.OTHER, "")] == pytest.approx(0.01)
    assert sum(seconds.values()) == pytest.approx(0.06)
    with timings.phase("ignored"):  # outside `collect`: nothing is measured
        pass
    log = TimingsLog(tmp_path / "timings.csv")
    builds = [(timings.BUILD, f"m{i}", float(i + 1)) for i in range(time_spent.TOP_BUILDS + 2)]
    log.append("t", "s", [(timings.PREFILL, "", 100.0), *builds])
    table = time_spent.time_table(tmp_path)
    assert table["phase"].tolist()[:2] == [timings.PREFILL, "build m6"]
    assert table["phase"].tolist()[-1] == "build (2 other methods)" and table["seconds"].iloc[-1] == 3.0
    assert table["share"].sum() == pytest.approx(1.0)


def test_staged_seconds_are_kept_when_the_lines_reached_the_disk_and_dropped_when_not(tmp_path):
    """What a stopped run staged: appended once (rows it half appended cut first) when all the sample's lines
    are on disk; dropped when they are not, since that sample runs again."""
    from ripplekv.runs.timings import PENDING

    path, lines = tmp_path / "timings.csv", [{"method": "full", "budget": None}, {"method": "snapkv", "budget": 32}]
    log = TimingsLog(path)
    log.append("niah", "a", [(timings.PREFILL, "", 1.0)])
    log.stage("niah", "b", [(timings.PREFILL, "", 2.0), (timings.BUILD, "snapkv", 0.5)], lines)
    with path.open("a") as fh:  # stopped while appending its rows: one whole, one torn
        fh.write("niah,b,1,prefill,,2.000000\nniah,b,1,bu")
    written = {("full", None), ("snapkv", 32)}
    TimingsLog(path).settle({("niah", "a"): {"variants": written}, ("niah", "b"): {"variants": written}})
    rows = read_timings(path)
    assert rows[["sample_id", "job", "phase", "seconds"]].values.tolist() == [
        ["a", 1, timings.PREFILL, 1.0], ["b", 1, timings.PREFILL, 2.0], ["b", 1, timings.BUILD, 0.5]]
    assert not (tmp_path / PENDING).exists()
    before = path.read_bytes()
    log = TimingsLog(path)
    log.stage("niah", "c", [(timings.PREFILL, "", 3.0)], lines)
    TimingsLog(path).settle({("niah", "c"): {"variants": {("full", None)}}})  # one of its two lines only
    assert path.read_bytes() == before and not (tmp_path / PENDING).exists()


def test_a_sample_written_but_not_timed_gets_one_untimed_row_and_the_report_counts_it(tmp_path):
    """Lines on disk but no timings row (from a version that wrote no staged seconds): the next run cannot time
    it without running it again, so it marks it once; the report counts every sample of the predictions."""
    log = TimingsLog(tmp_path / "timings.csv")
    log.append("niah", "a", [(timings.PREFILL, "", 1.5)])
    assert log.mark_untimed([("niah", "a"), ("niah", "b")]) == 1
    assert TimingsLog(tmp_path / "timings.csv").mark_untimed([("niah", "a"), ("niah", "b")]) == 0  # once
    assert time_spent.samples_timed(tmp_path) == (1, 1)
    table = time_spent.time_table(tmp_path)
    assert list(table["phase"]) == [timings.PREFILL]  # the mark is no phase
    text = time_spent.time_markdown(table, time_spent.samples_timed(tmp_path))
    assert "over the 1 of 2 samples timed" in text and "1 sample was written but not timed" in text
    assert "over the 3 samples timed" in time_spent.time_markdown(table, (3, 0))
