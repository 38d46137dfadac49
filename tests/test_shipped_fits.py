"""The results page names the rows that read a file fitted before the run, and what that file was fitted on."""

import json

from ripplekv.analysis.shipped_fits import fitted_elsewhere_lines

LUKV = {"preset": "lukv", "allocator": {"name": "lukv", "rounding": "exact"}, "scorer": {"name": "lukv", "window": 1}}
KVZAP = {"preset": "kvzap", "allocator": {"name": "uniform"}, "scorer": {"name": "kvzap", "window": 32, "model": "mlp"}}


def run_with(tmp_path, specs: dict, model=None):
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "method_specs": specs}))
    return tmp_path


def test_the_shipped_curve_and_surrogate_are_named_with_their_calibration(tmp_path):
    specs = {"lukv": LUKV, "kvzap": KVZAP, "snapkv": {"allocator": {"name": "uniform"}, "scorer": {"name": "snapkv"}}}
    line = fitted_elsewhere_lines(run_with(tmp_path, specs))[1]
    assert line.startswith("**Fitted before this run.**")
    # the shipped sidecars: LU-KV's curve on 8 prompts of 3500 tokens (niah among them), KVzap's on 4 of 500
    assert "`lukv` reads `smollm2-135m-lukv.csv`, fitted on 8 calibration prompts of 3500 tokens (" in line
    assert "niah" in line.split("`lukv` reads", 1)[1].split(";", 1)[0]
    assert "`kvzap` reads `smollm2-135m-mlp.safetensors`, fitted on 4 calibration prompts of 500 tokens" in line
    assert "snapkv" not in line.split(": ", 1)[1].split(". `make study`")[0]


def test_a_run_fitting_its_own_files_or_on_another_model_has_no_such_line(tmp_path):
    own = {"lukv": {**LUKV, "allocator": {**LUKV["allocator"], "curve": "runs/curve-lukv.csv"}},
           "kvzap": {**KVZAP, "scorer": {**KVZAP["scorer"], "weights": "runs/kvzap-mlp.safetensors"}}}
    assert fitted_elsewhere_lines(run_with(tmp_path, own)) == []
    assert fitted_elsewhere_lines(run_with(tmp_path, {"lukv": LUKV}, model="gemma3-270m")) == []
