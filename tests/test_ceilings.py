"""Whether a variant knows the full cache's answer follows from its parts (`knows_answer` on scorers and
allocators), not from its name: a composition on the oracle's scores is a ceiling everywhere (ranks, plots,
summary, route candidates, inspect), recorded per run in config.json, with runs that predate the record
falling back to the names in `defaults.CEILINGS`."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ripplekv.errors import UserError
from ripplekv.methods import make_method

AWARE = ["oracle", "oracle:window=32", "snapkv:scorer=oracle", "snapkv:scorer=oracle:split=adakv",
         "pyramidkv:scorer=oracle", "cake:scorer=oracle"]
REAL = ["snapkv", "pyramidkv:split=adakv", "cake", "streamingllm", "full", "gracekv"]


@pytest.mark.parametrize("spec", AWARE + REAL)
def test_knowing_the_answer_follows_from_the_parts(spec):
    assert make_method(spec).knows_answer == (spec in AWARE)


def test_a_route_with_one_oracle_layer_knows_the_answer(tmp_path):
    route = tmp_path / "route.csv"
    route.write_text("layer,method\n0,snapkv\n1,oracle\n2,snapkv\n3,h2o\n")
    assert make_method("routed", route=str(route)).knows_answer
    route.write_text("layer,method\n0,snapkv\n1,tova\n2,snapkv\n3,h2o\n")
    assert not make_method("routed", route=str(route)).knows_answer


def test_an_answer_aware_composition_is_no_route_candidate():
    from ripplekv.pipeline.route import candidate_methods

    with pytest.raises(UserError, match="answer-aware"):
        candidate_methods(["snapkv", "snapkv:scorer=oracle:split=adakv"])


@pytest.mark.slow
def test_eval_ranks_only_the_real_method_and_marks_the_composition_a_ceiling(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", tiny_model_dir, "--methods", "snapkv,snapkv:scorer=oracle",
                           "--tasks", "niah", "--limit", "2", "--target-tokens", "300", "--budget", "48,64",
                           "--out", out)
    assert code == 0, err
    assert "note: snapkv:scorer=oracle reads the full cache's answer" in err
    config = json.loads((out / "config.json").read_text())
    assert config["answer_aware"] == ["snapkv:scorer=oracle"]
    board = pd.read_csv(out / "leaderboard.csv")
    aware = board[board["method"] == "snapkv:scorer=oracle"]
    assert len(aware) == 2 and aware["rank"].isna().all() and (aware["kl_verdict"] == "answer-aware").all()
    assert (board.loc[board["method"] == "snapkv", "rank"] == 1).all()
    ranks = pd.read_csv(out / "ranks.csv")
    assert set(ranks["method"]) == {"snapkv"}
    summary = (out / "summary.md").read_text()
    assert "Answer-aware, not methods: `snapkv:scorer=oracle` reads the full cache's answer" in summary

    # A run written before the record: its ceilings are decided by name (here none), and a grown run keeps the record.
    del config["answer_aware"]
    (out / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("report", out)
    assert code == 0, err
    old = pd.read_csv(out / "leaderboard.csv")
    assert old.loc[old["method"] == "snapkv:scorer=oracle", "rank"].notna().all()
    assert (old.loc[old["method"] == "snapkv:scorer=oracle", "kl_verdict"] != "answer-aware").all()
    code, _, err = run_cli("eval", "--model", tiny_model_dir, "--methods", "snapkv,snapkv:scorer=oracle,allocation-ceiling",
                           "--tasks", "niah", "--limit", "2", "--target-tokens", "300", "--budget", "48,64",
                           "--out", out)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["answer_aware"] == ["snapkv:scorer=oracle", "allocation-ceiling"]
    board = pd.read_csv(out / "leaderboard.csv")
    assert board.loc[board["method"] != "snapkv", "rank"].isna().all()


def test_inspect_refuses_an_answer_aware_composition_before_any_work(tiny_model_dir, tmp_path, run_cli):
    out = tmp_path / "i"
    code, _, err = run_cli("inspect", "--model", tiny_model_dir, "--method", "snapkv:scorer=oracle:split=adakv",
                           "--task", "niah", "--target-tokens", "300", "--budget", "32", "--out", out)
    assert code == 2 and err.count("\n") == 1 and "full cache's answer" in err and "Traceback" not in err, err
    assert not out.exists()
