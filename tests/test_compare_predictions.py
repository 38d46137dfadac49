"""scripts/compare_predictions.py: what counts as the same run line by line (the refactor check's evidence)."""

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def compare():
    return load_script("compare_predictions")


def write_run(folder, rows):
    folder.mkdir()
    (folder / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def row(method, **fields):
    return {"task": "niah", "id": "s0", "method": method, "budget": 64, "prediction": "42", "kl": 0.5,
            "peak_memory_bytes": 1, **fields}


def test_a_changed_prediction_and_a_kl_past_the_tolerance_are_differences_a_field_added_since_is_not(compare, tmp_path):
    old = compare.lines(write_run(tmp_path / "old", [row("snapkv"), row("tova"), row("h2o")]))
    new = compare.lines(write_run(tmp_path / "new", [
        row("snapkv", kl=0.5 + 1e-7, peak_memory_bytes=9, kv_bytes=10),  # rounding and a measured field: equal
        row("tova", prediction="41", kv_bytes=10), row("h2o", kl=0.51, kv_bytes=10)]))
    skipped = compare.one_sided_fields(old, new)
    assert skipped == {"kv_bytes"}
    found = compare.differences(old, new, 1e-5, skipped)
    assert len(found) == 2
    assert any("tova" in line and "prediction" in line for line in found)
    assert any("h2o" in line and "kl" in line for line in found)
    assert compare.differences(old, new, 1e-5) != found  # compared, the added field differs in every line


def test_a_line_only_one_run_has_is_a_difference(compare, tmp_path):
    old = compare.lines(write_run(tmp_path / "old", [row("snapkv"), row("tova")]))
    new = compare.lines(write_run(tmp_path / "new", [row("snapkv")]))
    assert compare.differences(old, new, 1e-5) == ["only in the first run: ('niah', 's0', 'tova', 64)"]


def test_a_folder_without_result_lines_is_one_clear_line(compare, tmp_path):
    with pytest.raises(SystemExit, match="no .*predictions.jsonl: give the --out folders of two evals"):
        compare.lines(tmp_path)
    (tmp_path / "predictions.jsonl").write_text(json.dumps(row("snapkv")) + "\n" + '{"task": "niah"}\n')
    with pytest.raises(SystemExit, match="line 2 of .* is not an eval's result line"):
        compare.lines(tmp_path)

