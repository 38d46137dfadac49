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


def test_the_issue_63_set_is_26_variants_of_our_specs_and_not_in_the_default_run(bench):
    presses = bench.SETS["issue 63 presses"]
    assert len(bench.variants(presses, (128, 512))) == 26
    assert {bench.base(s) for s in presses} == {"chunkkv", "eg-chunkkv", "chunkpress", "lagkv", "leverage", "noncausal",
                                                "compactor", "cur", "capkv", "kvcompose", "finch", "kvgrad", "simlayerkv"}
    for spec in presses:
        make_method(spec)
    assert "issue 63 presses" not in bench.DEFAULT_SETS and set(bench.DEFAULT_SETS) < set(bench.SETS)
    assert bench.pick("finch,tova") == ("tova", "finch")


def test_the_ratio_of_the_issue_63_presses_keeps_the_budget_as_each_press_rounds_it(bench):
    layers, heads = 30, 3
    for length in (809, 3474):
        for budget in (128, 512):
            entries = layers * heads * length
            for press in ("KVgradPress", "KVzipPress"):  # all but int(entries x ratio) of the whole cache
                assert entries - int(entries * bench.keep_ratio(budget, length, press, entries)) == layers * heads * budget
            ratio = bench.keep_ratio(budget, length, "KVComposePress", entries, layers)
            assert int(layers * length * (1 - ratio)) == layers * budget  # token slots over the layers
            for press in ("ChunkKVPress", "ChunkPress"):  # whole chunks at 1 - B/n, as chunk_rounding=kvpress reads it
                assert bench.keep_ratio(budget, length, press) == 1 - budget / length


class Config:
    num_hidden_layers, num_key_value_heads = 30, 3


def press_named(name, **fields):
    """A stand-in for a kvpress press: set_up reads only its class name and sets attributes."""
    press = type(name, (), {"compress": lambda self, module, *args: ("compressed", module.layer_idx)})()
    press.__dict__.update(fields)
    return press


def test_set_up_tells_finch_its_question_part_seeds_the_sketches_and_leaves_simlayerkv_its_threshold(bench):
    import torch

    finch = press_named("FinchPress")
    bench.set_up(finch, 128, 1000, 940, Config)
    assert finch.window_size == 60 and finch.delimiter_token_id == -1
    assert int(1000 * (1 - finch.compression_ratio)) == 128
    simlayerkv = press_named("SimLayerKVPress")
    bench.set_up(simlayerkv, 128, 1000, None, Config)
    assert "compression_ratio" not in simlayerkv.__dict__  # kvpress refuses a ratio: its threshold decides
    compactor = press_named("CompactorPress")
    bench.set_up(compactor, 250, 1000, None, Config)
    assert compactor.blending == 0.75

    class Layer:
        layer_idx = 7

    assert compactor.compress(Layer(), None) == ("compressed", 7)
    drawn = torch.randn(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.randn(3))  # the draw after the call is layer 7's seeded draw, as check-references'


def test_the_kept_set_lines_come_from_a_check_references_run_of_some_pairs_only(bench, tmp_path, monkeypatch):
    """A `check_references.py --only finch` directory has no snapkv arrays: its pairs' lines are printed all the same."""
    import json

    import numpy as np

    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))
    kept = np.array([[[0, 1, 5]]])  # [L, H, kept] positions
    np.savez(tmp_path / "ours_prompt_0.npz", **{"finch/128/positions": kept, "finch/128/counts": np.array([[3]])},
             meta=json.dumps({"task": "niah", "tokens": 6}))
    np.savez(tmp_path / "reference_prompt_0.npz", **{"finch/128/0": np.array([[0, 1, 4]])})
    lines = bench.kept_lines(tmp_path)
    assert "1 prompts, B = [128]" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("finch") and "identical kept sets 0.0000 of 1" in lines[1]
