"""A sliding-window model and prompts longer than its window: refused before any model work, with no run
folder left behind, naming an option the command takes and a value that fits (chat template and answer
included), which then passes every check and goes on to load the model.

The advised values are not run to the end (a whole eval, profile, sweep or inspect each): that the engine
takes what the check lets through is checked directly (`test_the_engine_takes_what_the_window_check_lets_through`)."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from tests.conftest import TINY

WINDOW = 400


@pytest.fixture(scope="module")
def windowed_model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-mistral-window")
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), sliding_window=WINDOW,
                           **{**TINY, "hidden_size": 32, "intermediate_size": 64})
    model = MistralForCausalLM(config).eval()
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _advice(err: str, option: str) -> int:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"sliding_window={WINDOW}" in err, err
    return int(re.search(rf"pass {option} (\d+) or less", err).group(1))


@pytest.fixture
def model_reached(monkeypatch):
    """Loading the model ends the command with one recognisable line: every check before it has passed."""
    from ripplekv.engine import models
    from ripplekv.errors import UserError

    def reached(*args, **kwargs):
        raise UserError("reached the model")

    monkeypatch.setattr(models, "load_model", reached)


def _went_on(result: tuple[int, str, str]) -> None:
    """The command took the advised value: it passed its checks and went on to load the model."""
    code, _, err = result
    assert code == 2 and err.strip().splitlines()[-1] == "error: reached the model", err
    assert "sliding_window" not in err, err


def test_the_engine_takes_what_the_window_check_lets_through(windowed_model_dir):
    """The check lets through a prompt plus answer of at most window - 1 tokens (a sliding cache keeps window - 1
    prefilled entries); the engine's own length check, at run time, takes exactly those and refuses one more."""
    from transformers import AutoConfig

    from ripplekv.engine.adapter import check_length
    from ripplekv.errors import UserError
    from ripplekv.pipeline.samples import check_window

    config = AutoConfig.from_pretrained(windowed_model_dir)
    check_window(WINDOW, lambda n: n, "--max-length", WINDOW - 1, 2)
    check_length(config, WINDOW - 1 - 32, 32)
    with pytest.raises(UserError, match="pass --max-length 399 or less"):
        check_window(WINDOW, lambda n: n, "--max-length", WINDOW, 2)
    with pytest.raises(UserError, match=f"sliding_window={WINDOW}"):
        check_length(config, WINDOW - 32, 32)


def test_eval_advises_a_max_length_that_fits_before_any_model_work(windowed_model_dir, tmp_path, run_cli,
                                                                  model_reached):
    args = ["eval", "--model", windowed_model_dir, "--methods", "snapkv", "--tasks", "niah", "--limit", "1",
            "--target-tokens", "500", "--budget", "64"]
    code, _, err = run_cli(*args, "--out", tmp_path / "refused")
    assert code == 2
    fits = _advice(err, "--max-length")
    assert not (tmp_path / "refused").exists()
    _went_on(run_cli(*args, "--max-length", fits, "--out", tmp_path / "run"))
    code, _, err = run_cli(*args, "--max-length", fits + 40, "--out", tmp_path / "over")
    assert code == 2 and "--max-length" in err and not (tmp_path / "over").exists()


def test_profile_advises_a_target_tokens_it_takes(windowed_model_dir, tmp_path, run_cli, model_reached):
    args = ["profile", "--model", windowed_model_dir, "--calib-samples", "1"]
    code, _, err = run_cli(*args, "--target-tokens", "500", "--out", tmp_path / "refused")
    assert code == 2
    assert "--max-length" not in err
    fits = _advice(err, "--target-tokens")
    assert not (tmp_path / "refused").exists()
    _went_on(run_cli(*args, "--target-tokens", fits, "--out", tmp_path / "run"))


def test_no_value_fits_says_so_in_one_line(tokenizer):
    from ripplekv.errors import UserError
    from ripplekv.pipeline.samples import check_window

    with pytest.raises(UserError, match=r"no --max-length fits \(even 2 builds 300 tokens\)"):
        check_window(256, lambda length: 298 + min(length, 2), "--max-length", 7500, 2)


def test_allocate_sweep_advises_a_target_tokens_that_fits(windowed_model_dir, tmp_path, run_cli, model_reached):
    sens = tmp_path / "sens.csv"
    sens.write_text("layer,kl_mean\n0,0.1\n1,0.4\n2,0.2\n3,0.3\n")
    args = ["allocate", sens, "--model", windowed_model_dir, "--ratio", "1", "--ratio", "4", "--budget", "32",
            "--calib-samples", "2"]
    code, _, err = run_cli(*args, "--target-tokens", "500", "--out", tmp_path / "refused.csv")
    assert code == 2
    fits = _advice(err, "--target-tokens")
    assert not list(tmp_path.glob("refused*"))
    _went_on(run_cli(*args, "--target-tokens", fits, "--out", tmp_path / "alloc.csv"))


def test_route_says_when_no_target_fits_before_making_its_folder(windowed_model_dir, tmp_path, run_cli):
    code, _, err = run_cli("route", "--model", windowed_model_dir, "--methods", "snapkv,h2o", "--target-tokens", "500",
                           "--out", tmp_path / "r")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "no --target-tokens fits" in err and "with one of at least" in err
    assert not (tmp_path / "r").exists()


def test_inspect_advises_a_max_length_before_making_its_folder(windowed_model_dir, tmp_path, run_cli, model_reached):
    args = ["inspect", "--model", windowed_model_dir, "--method", "snapkv", "--budget", "32", "--task", "niah",
            "--target-tokens", "500"]
    code, _, err = run_cli(*args, "--out", tmp_path / "refused")
    assert code == 2
    fits = _advice(err, "--max-length")
    assert not (tmp_path / "refused").exists()
    _went_on(run_cli(*args, "--max-length", fits, "--out", tmp_path / "i"))
