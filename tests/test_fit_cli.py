"""`ripplekv fit lukv|kvzap|qfilter|compresskv`: every method fitted on calibration prompts is a command, reading the
calibration prompts through one `Calibration`, refusing a mistake in one line before the model loads, and (for the
long fits) resuming."""

from __future__ import annotations

import json
import re

import pytest

from ripplekv.errors import UserError
from ripplekv.tasks.calibration import Calibration, Draw
from tests.conftest import invoke as run


def test_the_fitting_commands_are_listed_in_help():
    top = run("--help")
    assert top.returncode == 0 and re.search(r"\bfit +Fit lukv, kvzap, fastkvzip, qfilter, compresskv or duoattention", top.stdout), top.stdout
    fit = run("fit", "--help")
    assert fit.returncode == 0
    for name in ("lukv", "kvzap", "fastkvzip", "qfilter", "compresskv", "duoattention"):
        assert f"  {name} " in fit.stdout, fit.stdout


@pytest.mark.parametrize("change, message", [
    (dict(samples=0), "--calib-samples must be at least 1, got 0"),
    (dict(target_tokens=10), "--target-tokens must be 256 to 131072, got 10"),
    (dict(draw=Draw(2, 2)), "--calib-draw must be an integer from 0 to 1"),
])
def test_a_calibration_is_checked_in_one_place(change, message):
    with pytest.raises(UserError, match=message):
        Calibration(**{"samples": 2, "target_tokens": 300, **change}).check()


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget must be a positive integer"),
    (["--calib-samples", "0"], "--calib-samples must be at least 1"),
    (["--target-tokens", "10"], "--target-tokens must be"),
    (["--window", "0"], "--window must be at least 1"),
    (["--calib-draw", "3", "--calib-draws", "2"], "--calib-draw must be an integer from 0 to 1"),
    (["--out", "{tmp}/a-file/p.csv"], "a-file is a file, not a directory"),
])
def test_fit_compresskv_refuses_in_one_line_before_the_model(tmp_path, args, message):
    (tmp_path / "a-file").write_text("x")
    filled = [a.format(tmp=tmp_path) for a in args]
    out = [] if "--out" in filled else ["--out", str(tmp_path / "p.csv")]
    result = run("fit", "compresskv", *out, *filled)  # the bundled model: found, never loaded
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


@pytest.mark.parametrize("command, args, message", [
    ("lukv", ["--answer-tokens", "0"], "--answer-tokens must be positive"),
    ("lukv", ["--methods", "snapkv"], "does not read a head-budget curve"),
    ("kvzap", ["--holdout", "1"], "--holdout at least 2"),
    ("kvzap", ["--calib-samples", "2"], "must be at least --holdout (4)"),
    ("kvzap", ["--models", "tree"], "tree"),
])
def test_fit_lukv_and_kvzap_refuse_in_one_line(tmp_path, tiny_model_dir, command, args, message):
    result = run("fit", command, "--model", tiny_model_dir, "--out", tmp_path / "out", "--target-tokens", 300, *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fit_compresskv_averages_the_layer_errors_as_one_calibrate_call(tmp_path, tiny_model_dir):
    from ripplekv.engine.models import load_model
    from ripplekv.methods.compresskv import calibrate

    out = tmp_path / "nested" / "compresskv.csv"
    result = run("fit", "compresskv", "--model", tiny_model_dir, "--calib-samples", 3, "--budget", 16,
                 "--window", 8, "--target-tokens", 300, "--device", "cpu", "--out", out)
    assert result.returncode == 0, result.stderr
    model, tokenizer, _ = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    prompts = Calibration(3, 300).prompts(tokenizer)
    errors = calibrate(model, [p.context + p.probe for p in prompts], 16, 8)
    expected = "layer,error\n" + "".join(f"{layer},{error!r}\n" for layer, error in enumerate(errors))
    assert out.read_text() == expected  # the per-prompt loop (for the bar) sums exactly as calibrate does
    assert f"wrote: {out}" in result.stderr


@pytest.mark.slow
def test_fit_kvzap_writes_both_surrogates_and_resumes(tmp_path, tiny_model_dir):
    args = ["fit", "kvzap", "--model", tiny_model_dir, "--calib-samples", 2, "--holdout", 2, "--tokens", 16,
            "--epochs", 1, "--target-tokens", 300, "--device", "cpu", "--out", tmp_path / "kvzap"]
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith(f"fit kvzap: writing to {tmp_path / 'kvzap'}\n"), first.stderr
    for kind in ("mlp", "linear"):
        provenance = json.loads((tmp_path / "kvzap" / f"kvzap-{kind}.json").read_text())
        provenance = {key: provenance[key] for key in list(provenance)[list(provenance).index("model"):]}
        assert list(provenance)[:7] == ["model", "calib_samples", "target_tokens", "tokens", "holdout", "epochs", "seed"]
        assert provenance["calib_samples"] == 2 and "calib_draw" not in provenance
    log = (tmp_path / "kvzap" / "samples.jsonl").read_text()
    again = run(*args)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "kvzap" / "samples.jsonl").read_text() == log  # every prompt was done: none collected again
    other = run(*args[:-2], "--calib-draw", 1, "--calib-draws", 2, "--out", tmp_path / "kvzap")
    assert other.returncode == 2 and "use a new --out directory" in other.stderr  # another draw, another folder


@pytest.mark.slow
def test_fit_lukv_writes_a_curve_per_scorer_with_its_draw(tmp_path, tiny_model_dir):
    out = tmp_path / "lukv"
    result = run("fit", "lukv", "--model", tiny_model_dir, "--methods", "lukv:scorer=snapkv", "--calib-samples", 1,
                 "--calib-draw", 1, "--calib-draws", 2, "--answer-tokens", 4, "--target-tokens", 300,
                 "--device", "cpu", "--out", out)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"fit lukv: writing to {out}\n") and f"{out / 'curve-snapkv.csv'}" in result.stderr
    provenance = json.loads((out / "curve-snapkv.json").read_text())
    assert list(provenance)[:7] == ["model", "calib_samples", "target_tokens", "answer_tokens", "layerwise",
                                    "calib_draw", "calib_draws"]
    assert provenance["calib_draw"] == 1 and provenance["answer_tokens"] == 4
    lines = (out / "curve-snapkv.csv").read_text().splitlines()
    assert lines[0] == "ratio,layer,head,prune" and len(lines) == 1 + 99 * 4 * 2
