"""`ripplekv profile` and `ripplekv allocate` end to end on a tiny model, and their one-line errors."""

import json

import pandas as pd
import pytest

from tests.conftest import invoke as run


@pytest.fixture(scope="module")
def profiled(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    result = run("profile", "--model", tiny_model_dir, "--calib-samples", 4, "--seeds", 1, "--eta", 1.0,
                 "--target-tokens", 300, "--out", out)
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.mark.slow
def test_profile_writes_every_output(profiled):
    out, result = profiled
    table = pd.read_csv(out / "sensitivity.csv")
    assert list(table.columns) == ["layer", "kl_mean", "kl_std", "kl_median", "n_samples"]
    assert len(table) == 4 and (table["kl_mean"] > 0).all() and (table["n_samples"] == 4).all()
    meta = json.loads((out / "profile.json").read_text())
    assert meta["eta"] == 1.0 and meta["signal"] == "noise" and len(meta["calibration_ids"]) == 4
    assert meta["target_tokens"] == 300  # the calibration table of `ripplekv study` reads it
    assert all("calibration" in sample_id for sample_id in meta["calibration_ids"])
    assert "split-half Spearman rho" in result.stderr
    assert len(pd.read_csv(out / "per_sample.csv")) == 4 * 4
    assert (out / "sensitivity.png").stat().st_size > 1000


@pytest.mark.slow
def test_allocate_with_a_ratio_sweep_picks_by_calibration(profiled, tiny_model_dir, tmp_path):
    out, _ = profiled
    alloc = tmp_path / "alloc.csv"
    result = run("allocate", out / "sensitivity.csv", "--model", tiny_model_dir, "--ratio", 1, "--ratio", 4,
                 "--budget", 32, "--calib-samples", 2, "--target-tokens", 300, "--out", alloc)
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(alloc)
    assert list(table.columns) == ["layer", "sensitivity", "multiplier", "map"] and (table["map"] == "exponential").all()
    assert table["multiplier"].mean() == pytest.approx(1.0)
    sweep = pd.read_csv(tmp_path / "alloc.sweep.csv")
    choice = json.loads((tmp_path / "alloc.choice.json").read_text())
    chosen = choice["ratio"]
    assert {1.0, 4.0} <= set(sweep["ratio"]) and sweep["chosen"].sum() == 1
    assert chosen == sweep.sort_values(["kl", "ratio"]).iloc[0]["ratio"] and choice["initial"] == [1.0, 4.0]
    # The pick is bracketed by the grid (extended by doubling when 4 won), or its note says why not.
    grid = sorted(sweep["ratio"])
    assert grid == choice["candidates"] and grid[: 2] == [1.0, 4.0] and grid[2:] == [4.0 * 2 ** k for k in range(1, len(grid) - 1)]
    assert min(grid) < chosen < max(grid) or choice["notes"]
    assert table["multiplier"].max() / table["multiplier"].min() == pytest.approx(chosen)
    assert (tmp_path / "alloc.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args, message",
    [
        (["allocate", "{sens}", "--ratio", "0.5", "--out", "{tmp}/a.csv"], "--ratio must be a number >= 1"),
        (["allocate", "{tmp}/missing.csv", "--out", "{tmp}/a.csv"], "does not exist"),
        (["allocate", "{bad}", "--out", "{tmp}/a.csv"], "has 2 layers but the model has 4"),
        (["profile", "--signal", "prune", "--out", "{tmp}/p"], "'prune' is not one of 'noise', 'evict', 'infonce'"),
        (["profile", "--calib-samples", "0", "--out", "{tmp}/p"], "--calib-samples must be at least 1"),
        (["profile", "--signal", "infonce", "--calib-samples", "1", "--out", "{tmp}/p"], "--calib-samples 2 or more"),
        (["profile", "--signal", "evict", "--prune-ratio", "1", "--out", "{tmp}/p"], "--prune-ratio must be a share"),
        (["profile", "--calib-tasks", "longbench:hotpotqa", "--out", "{tmp}/p"], "only the generated suites"),
        (["fit", "lukv", "--calib-tasks", "nosuch", "--out", "{tmp}/p"], "nosuch"),
        (["budgets", "--methods", "ripplekv"], "run `ripplekv profile`"),
        (["budgets", "--pooling", "median"], "'median' is not one of 'max', 'avg', 'none'"),
        (["budgets", "--budget", "0"], "budget must be a positive integer"),
        (["budgets", "--budget", "1.5"], "budget must be a positive integer, got '1.5'"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(profiled, tiny_model_dir, tmp_path, args, message):
    out, _ = profiled
    bad = tmp_path / "bad.csv"
    bad.write_text("layer,kl_mean\n0,1\n1,2\n")
    filled = [a.format(sens=out / "sensitivity.csv", tmp=tmp_path, bad=bad) for a in args]
    result = run(*filled, "--model", tiny_model_dir)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_budgets_command_prints_exact_matched_totals(tiny_model_dir):
    result = run("budgets", "--methods", "snapkv,pyramidkv,streamingllm", "--budget", 48, "--prompt-len", 500,
                 "--window", 16, "--format", "csv", "--model", tiny_model_dir)
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(__import__("io").StringIO(result.stdout))
    assert list(table.columns) == ["method", "layer", "budget"]
    totals = table.groupby("method")["budget"].sum()
    assert (totals == 4 * 48).all() and len(totals) == 3
    pyramid = table[table.method == "pyramidkv"]["budget"].tolist()
    assert pyramid == sorted(pyramid, reverse=True) and pyramid[0] > pyramid[-1]


@pytest.mark.slow
def test_the_pipeline_runs_without_out_or_allocation_flags(tiny_model_dir, tmp_path):
    """profile -> allocate -> eval in an empty directory: each stage writes to runs/<command>/ and the
    next one finds it there."""
    def here(*args):
        return run(*args, cwd=tmp_path)

    model = ("--model", tiny_model_dir)
    result = here("profile", *model, "--calib-samples", 2, "--target-tokens", 300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("profile: writing to runs/profile (the default")
    assert (tmp_path / "runs" / "profile" / "sensitivity.csv").is_file()
    result = here("allocate", *model)
    assert result.returncode == 0, result.stderr
    assert "read runs/profile/sensitivity.csv" in result.stderr
    result = here("eval", *model, "--budget", 32, "--tasks", "niah", "--limit", 1, "--target-tokens", 300)
    assert result.returncode == 0, result.stderr
    assert "using the last allocation, runs/allocate/allocation.csv" in result.stderr
    config = json.loads((tmp_path / "runs" / "eval" / "config.json").read_text())
    assert config["allocation"] == str(tmp_path / "runs" / "allocate" / "allocation.csv")
    assert "wrote: runs/eval/predictions.jsonl" in result.stderr


def test_the_bundled_model_has_a_shipped_allocation(tmp_path, monkeypatch):
    """One rule for the CLI and the API: the last `allocate`, else the shipped one for the bundled model, and
    nothing for methods that take no allocation."""
    from ripplekv.engine.models import load_config
    from ripplekv.engine.packaged import names_bundled
    from ripplekv.methods.allocators import read_allocation
    from ripplekv.pipeline.eval_plan import default_allocation

    monkeypatch.chdir(tmp_path)  # no runs/allocate here
    path, note = default_allocation(["snapkv", "ripplekv"], bundled=names_bundled(None))
    assert "shipped" in note
    assert len(read_allocation(path)) == load_config(None).num_hidden_layers
    assert default_allocation(["ripplekv"], bundled=names_bundled(str(tmp_path / "other"))) == (None, None)
    assert default_allocation(["snapkv"], bundled=True) == (None, None)  # no method takes one
    # every method that takes one names its own file: no default, and no notice naming a file nothing reads
    assert default_allocation(["snapkv", "ripplekv:allocation=mine.csv"], bundled=True) == (None, None)
    assert default_allocation(["ripplekv:allocation=mine.csv", "depthkv"], bundled=True)[0] is not None
    (tmp_path / "runs" / "allocate").mkdir(parents=True)
    (tmp_path / "runs" / "allocate" / "allocation.csv").write_text("layer,multiplier\n0,1\n")
    for bundled in (True, False):  # the last allocation first, for any model
        path, note = default_allocation(["depthkv"], bundled=bundled)
        assert path == "runs/allocate/allocation.csv" and "the last allocation" in note


def test_allocate_without_a_profile_says_what_to_run(tmp_path):
    result = run("allocate", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: no profile at runs/profile/sensitivity.csv: run `ripplekv profile` first, or pass a sensitivity.csv\n"


@pytest.mark.slow
def test_depthkv_task_drop_profile_then_a_proportional_allocation(tiny_model_dir, tmp_path):
    """The default `--signal evict` measure is the task drop at 60% pruned; `allocate --map proportional` reads
    its `sensitivity` column (the mean drop clipped at 0)."""
    out = tmp_path / "drop"
    result = run("profile", "--model", tiny_model_dir, "--signal", "evict", "--calib-samples", 3, "--target-tokens", 300,
                 "--out", out)
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "profile.json").read_text())
    assert meta["measure"] == "task-drop" and meta["prune_ratio"] == 0.6 and meta["evict_method"] == "h2o"
    assert len(meta["full_scores"]) == 3 and all(0 <= s <= 1 for s in meta["full_scores"])
    table = pd.read_csv(out / "sensitivity.csv")
    assert list(table.columns) == ["layer", "drop_mean", "drop_std", "drop_median", "n_samples", "sensitivity"]
    assert (table["sensitivity"] == table["drop_mean"].clip(lower=0)).all()
    per_sample = pd.read_csv(out / "per_sample.csv")
    assert list(per_sample.columns) == ["sample_id", "seed", "layer", "drop"] and len(per_sample) == 3 * 4
    alloc = tmp_path / "depthkv.csv"
    result = run("allocate", out / "sensitivity.csv", "--model", tiny_model_dir, "--map", "proportional", "--out", alloc)
    assert result.returncode == 0, result.stderr
    multipliers = pd.read_csv(alloc)["multiplier"]
    assert multipliers.mean() == pytest.approx(1.0)
    sensitivity = table["sensitivity"].to_numpy()
    if sensitivity.sum() > 0:
        assert multipliers.to_numpy() == pytest.approx(sensitivity / sensitivity.mean())
    result = run("profile", "--model", tiny_model_dir, "--signal", "evict", "--with-answer", "--out", tmp_path / "x")
    assert result.returncode == 2 and "--measure kl" in result.stderr


@pytest.mark.slow
def test_infonce_profile_writes_its_bound(tiny_model_dir, tmp_path):
    out = tmp_path / "infonce"
    result = run("profile", "--model", tiny_model_dir, "--signal", "infonce", "--calib-samples", 3, "--target-tokens", 300,
                 "--out", out)
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "profile.json").read_text())
    assert "measure" not in meta and len(meta["infonce_mi_bound"]) == 4 and meta["temperature"] == 0.1
    table = pd.read_csv(out / "sensitivity.csv")
    assert (table["infonce_mean"] > 0).all()
    assert table["sensitivity"].to_numpy() == pytest.approx(pd.Series(meta["infonce_mi_bound"]).clip(lower=0).to_numpy())


def test_a_profile_on_chosen_tasks_of_another_suite_records_them(tiny_model_dir, run_cli, tmp_path):
    """`--calib-tasks`: a study calibrates on its own tasks (RULER's calibration split here); the ids are that split's
    and the tasks are recorded, so a resume with other tasks cannot mix."""
    out = tmp_path / "p"
    code, _, err = run_cli("profile", "--model", str(tiny_model_dir), "--calib-samples", "2", "--seeds", "1",
                           "--target-tokens", "1024", "--calib-tasks", "ruler:vt,niah", "--out", str(out))
    assert code == 0, err
    meta = json.loads((out / "profile.json").read_text())
    assert meta["calib_tasks"] == ["ruler:vt", "niah"]
    assert [i.split("-calibration-")[0] for i in meta["calibration_ids"]] == ["ruler-vt", "offline-niah"]
