"""scripts/bench_peer.py without kvpress: its method sets, budgets-to-ratio rule and summary are what the issue asks."""

from pathlib import Path

import pytest

from ripplekv.errors import UserError
from ripplekv.methods import make_method
from tests.conftest import load_script, script_refusal


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_peer")


def test_the_sets_count_22_and_8_variants_at_two_budgets_and_every_spec_is_ours(bench):
    budgets = (128, 512)
    assert len(bench.variants(bench.SETS["22 variants"], budgets)) == 22
    cheap = bench.SETS["8 cheap variants"]
    assert len(bench.variants(cheap, budgets)) == 8
    assert {bench.base(s) for s in cheap} == {"streamingllm", "snapkv", "pyramidkv", "tova"}
    for spec in bench.METHODS:
        make_method(spec)  # a spec we could not build would fail eval, not the benchmark's own check


def test_pick_keeps_the_table_order_and_refuses_unknown_names_in_one_line(bench):
    assert bench.pick("tova, snapkv") == ("snapkv:kernel=5:pooling=avg", "tova")
    with pytest.raises(UserError, match="ripplekv not in both"):
        bench.pick("snapkv,ripplekv")


def test_the_ratio_keeps_the_budget_as_kvpress_rounds_it(bench):
    for length in (618, 3474):
        for budget in (64, 128, 512):
            assert int(length * (1 - bench.keep_ratio(budget, length))) == budget


def test_ratios_sum_the_repeats_per_set_and_cut_at_stop_drops_the_stop(bench):
    times = [{"set": "a", "repeat": 0, "peer_s": 10.0, "ours_s": 2.0}, {"set": "a", "repeat": 1, "peer_s": 8.0, "ours_s": 4.0},
             {"set": "b", "repeat": 0, "peer_s": 3.0, "ours_s": 3.0}]
    rows = {row["set"]: row for row in bench.ratios(times, {"a": (), "b": (), "c": ()})}
    assert set(rows) == {"a", "b"}
    assert rows["a"]["peer/ours"] == pytest.approx(3.0) and rows["a"]["range"] == "2.00-5.00"
    assert bench.cut_at_stop([5, 6, 2, 7], {2}) == [5, 6] and bench.cut_at_stop([5], {2}) == [5]


def test_without_check_references_files_the_kept_sets_are_one_line_saying_where_to_get_them(bench, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # the script finds check_references beside itself
    lines = bench.kept_lines(tmp_path)
    assert len(lines) == 1 and "make check-references" in lines[0] and str(tmp_path) in lines[0]


def test_the_curve_takes_the_first_methods_at_every_budget_and_refuses_what_no_eval_runs(bench):
    specs, budgets = tuple(bench.METHODS), (128, 512)
    assert bench.curve_grid(1, specs, budgets) == (specs[:1], (128,))
    assert bench.curve_grid(8, specs, budgets) == (bench.SETS["8 cheap variants"], budgets)  # the cheap set's run
    assert bench.curve_grid(22, specs, budgets) == (specs, budgets)
    for count in (0, 3, 24):
        with pytest.raises(UserError, match="--curve"):
            bench.curve_grid(count, specs, budgets)


@pytest.mark.parametrize("curve, message", [("1,x", "--curve takes numbers of variants"),
                                            ("3", "--curve: 3 variants is not 1..2")])
def test_a_bad_curve_is_one_line_before_any_venv_or_output_is_made(tmp_path, monkeypatch, capsys, curve, message):
    err = script_refusal("bench_peer", "--curve", curve, "--venv", tmp_path / "venv", "--out", tmp_path / "runs" / "b.csv",
                         cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
