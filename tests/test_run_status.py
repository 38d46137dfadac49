"""`--status`: where a staged run stands, read from its staging folder alone."""

import json
from pathlib import Path

from ripplekv.pipeline.run_status import run_status

REPO = Path(__file__).resolve().parents[1]


def staged_eval(folder: Path, planned: dict[str, int], seconds: dict[str, list[float]]) -> None:
    """An eval folder: its planned samples per task, and the timings of the samples done."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"samples": {t: [f"{t}-{i}" for i in range(n)]
                                                                for t, n in planned.items()}}))
    (folder / "predictions.jsonl").write_text("")
    rows = ["task,sample_id,job,phase,method,seconds"]
    for task, times in seconds.items():
        for i, total in enumerate(times):  # two phases a sample: the status sums them
            rows += [f"{task},{task}-{i},1,prefill,,{total / 2}", f"{task},{task}-{i},1,decode,snapkv,{total / 2}"]
    (folder / "timings.csv").write_text("\n".join(rows) + "\n")


def test_samples_done_per_task_and_the_time_left_at_the_pace_so_far(tmp_path):
    staging = tmp_path / "study"
    staged_eval(staging / "eval", {"a": 4, "b": 4, "c": 2}, {"a": [60, 60, 60, 60], "b": [600, 600]})
    staged_eval(staging / "pilot", {"a": 1}, {"a": [30]})
    (staging / "stages.csv").write_text("stage,seconds\nscreen,3000\npilot,600\npilot,30\n")
    lines = run_status(staging)
    assert lines[1] == "stages finished: screen, pilot (3 runs, 1 h 0 min in all)"
    # b: 2 left at its 600 s a sample; c, not started: 2 left at the mean of the 6 samples done (240 s)
    left = 2 * 600 + 2 * (4 * 60 + 2 * 600) / 6
    assert f"eval: 6 of 10 samples (a 4/4, b 2/4, c 0/2); about {int(left) // 60} min left at its pace so far" in lines
    assert "pilot: 1 of 1 samples (a 1/1), done" in lines


def test_no_run_in_progress_is_one_line(tmp_path):
    assert run_status(tmp_path / "missing") == [f"{tmp_path / 'missing'}: no run in progress (nothing staged)"]


def test_the_study_command_says_where_its_run_stands(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    staged_eval(tmp_path / "runs" / ".staging" / "study" / "eval", {"a": 2}, {"a": [90]})
    code, out, _ = run_cli("study", REPO / "configs" / "study.toml", "--status")
    assert code == 0 and "eval: 1 of 2 samples (a 1/2); about 1 min left at its pace so far" in out
    assert not (tmp_path / "results").exists()  # nothing ran
