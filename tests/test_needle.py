"""The needle heatmap's data: accuracy and KL per (method, budget, length, depth) from prediction lines."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from ripplekv.analysis import needle
from ripplekv.errors import UserError


def lines(rows) -> pd.DataFrame:
    """Prediction lines: (method, budget, depth, score, kl)."""
    frame = pd.DataFrame(rows, columns=["method", "budget", "depth", "score", "kl"])
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


SHORT = lines([
    ("full", None, 0.4, 1.0, 0.0), ("full", None, 51.0, 1.0, 0.0), ("full", None, 49.2, 0.0, 0.0),
    ("snapkv", 64, 0.4, 1.0, 0.2), ("snapkv", 64, 51.0, 0.0, 0.9), ("snapkv", 64, 49.2, 0.0, 0.5),
    ("streamingllm", 64, 0.4, 1.0, 0.1), ("streamingllm", 64, 51.0, 0.0, 2.0), ("streamingllm", 64, 49.2, 0.0, 3.0),
    ("snapkv", 128, 0.4, 1.0, 0.05),
])
LONG = lines([
    ("streamingllm", 64, 98.0, 1.0, 0.3), ("full", None, 98.0, 1.0, 0.0), ("snapkv", 64, 98.0, 0.0, 1.5),
    ("full", None, None, 1.0, 0.0),  # a line of another task, without a needle: left out
])


def test_the_grid_is_the_mean_per_cell_with_depths_rounded():
    grid = needle.needle_grid([(1000, SHORT), (2000, LONG)])
    assert list(grid.columns) == needle.GRID_COLUMNS
    cell = grid.set_index(["method", "budget", "length", "depth"])
    assert cell.loc[("snapkv", 64, 1000, 50), "n"] == 2  # 51.0 and 49.2 both round to 50
    assert cell.loc[("snapkv", 64, 1000, 50), "accuracy"] == 0
    assert cell.loc[("snapkv", 64, 1000, 50), "kl"] == pytest.approx(0.7)
    assert cell.loc[("full", pd.NA, 1000, 50), "accuracy"] == 50
    assert cell.loc[("streamingllm", 64, 2000, 100), "accuracy"] == 100
    assert grid["method"].iloc[0] == "full"  # the reference first, whatever the line order
    assert grid["n"].sum() == len(SHORT) + len(LONG) - 1


def test_panels_put_the_full_cache_first_and_blank_cells_stay_empty():
    grid = needle.needle_grid([(1000, SHORT), (2000, LONG)])
    shown = needle.panels(grid, 64)
    assert [method for method, _ in shown] == ["full", "snapkv", "streamingllm"]
    depths, lengths = [0, 50, 100], [1000, 2000]
    matrix = needle.cell_matrix(shown[1][1], "accuracy", depths, lengths)
    assert matrix[0, 0] == 100 and matrix[1, 0] == 0 and matrix[2, 1] == 0
    assert math.isnan(matrix[2, 0]) and math.isnan(matrix[0, 1])  # no sample: blank
    assert [m for m, _ in needle.panels(grid, 128)] == ["full", "snapkv"]


def test_coarser_depth_steps_merge_rows():
    grid = needle.needle_grid([(1000, SHORT)], depth_step=25)
    assert sorted(grid["depth"].unique()) == [0, 50]
    with pytest.raises(UserError, match="depth step"):
        needle.needle_grid([(1000, SHORT)], depth_step=0)
    with pytest.raises(UserError, match="no prediction line has a needle depth"):
        needle.needle_grid([(1000, SHORT.drop(columns="depth"))])


def test_the_figure_is_written_with_a_panel_per_method(tmp_path):
    grid = needle.needle_grid([(1000, SHORT), (2000, LONG)])
    path = tmp_path / "needle_b64.png"
    needle.plot_needle(grid, 64, path)
    assert path.stat().st_size > 1000
    with pytest.raises(UserError, match="no method besides the full cache"):
        needle.plot_needle(grid, 512, tmp_path / "x.png")


def test_needle_command_runs_each_length_and_draws(run_cli, tiny_model_dir, tmp_path):
    out = tmp_path / "needle"
    code, _, err = run_cli("needle", "--model", tiny_model_dir, "--lengths", "1024,1200", "--limit", 1,
                           "--budget", 64, "--methods", "snapkv", "--out", out)
    assert code == 0, err
    grid = pd.read_csv(out / "needle.csv")
    assert sorted(grid["length"].unique()) == [1024, 1200]
    assert sorted(grid["depth"].unique()) == [0]  # niah_depths: the first depth of its order
    assert set(grid["method"]) == {"full", "snapkv"} and (grid["n"] == 1).all()
    assert (out / "needle_b64.png").is_file()
    config = json.loads((out / "tokens-1200" / "config.json").read_text())
    assert config["tasks"] == ["niah_depths"] and config["target_tokens"] == 1200
    code, _, err = run_cli("needle", "--model", tiny_model_dir, "--lengths", "0", "--budget", 64, "--out", out)
    assert code == 2 and "--lengths takes positive token counts" in err


@pytest.mark.parametrize("args, message", [
    (["--task", "vt"], "task vt (ruler) records no needle depth, so it has no heatmap rows: pass --task niah_depths"),
    (["--suite", "offline", "--task", "hotpotqa"], "records no needle depth"),
    (["--depth-step", "0"], "--depth-step must be a whole percentage from 1 to 100, got 0"),
    (["--depth-step", "250"], "--depth-step must be a whole percentage from 1 to 100, got 250"),
    (["--lengths", "1024,300"], "--lengths must be RULER target lengths of 1024-131072 tokens, got 300"),
])
def test_needle_refuses_its_own_mistakes_before_any_eval(args, message, run_cli, tiny_model_dir, tmp_path, monkeypatch):
    from ripplekv.pipeline import evaluate

    monkeypatch.setattr(evaluate, "run_eval", lambda *a, **k: pytest.fail("an eval ran before the refusal"))
    out = tmp_path / "needle"
    code, _, err = run_cli("needle", "--model", tiny_model_dir, "--budget", 64, "--methods", "snapkv", "--out", out,
                           *args)
    assert code == 2 and err.count("error:") == 1 and message in err and not out.exists(), err
