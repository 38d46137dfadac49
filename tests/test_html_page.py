"""The web pages of results: the critical KV footprint, the page data, paired rankings, the site index, and the page
itself rendered in headless Chromium (sorting, filtering, plots, a screenshot), with the network never reached."""

from __future__ import annotations

import io
import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis import report
from ripplekv.analysis.footprint import add_footprint, critical_footprints
from ripplekv.analysis.html_page import page_html, write_compare_page, write_site
from ripplekv.analysis.page_data import run_page_data
from ripplekv.analysis.page_sets import paired_ranks
from ripplekv.methods.core.catalog import method_notes
from tests.chromium import Browser, chromium_binary
from tests.test_report import noisy_predictions, write


def board_of(rows: list[tuple]) -> pd.DataFrame:
    """(method, budget, agreement, low, high, score) rows as a leaderboard."""
    frame = pd.DataFrame(rows, columns=["method", "budget", "agreement", "agreement_ci_low", "agreement_ci_high",
                                        "avg_informative"])
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def test_the_footprint_is_the_smallest_budget_keeping_ninety_percent_with_its_interval():
    board = board_of([("full", None, 1.0, 1.0, 1.0, 80.0),
                      ("steady", 64, 0.80, 0.70, 0.91, 60.0),   # its interval reaches 0.9: the footprint's low end
                      ("steady", 128, 0.92, 0.88, 0.96, 73.0),  # the point reaches 0.9: the footprint
                      ("steady", 256, 0.97, 0.93, 1.00, 79.0),  # the interval lies above 0.9: the high end
                      ("short", 64, 0.50, 0.40, 0.60, 10.0),
                      ("short", 256, 0.85, 0.80, 0.89, 20.0)])  # never reaches it
    found = critical_footprints(board).set_index("method")
    assert found.loc["steady", ["footprint", "footprint_low", "footprint_high"]].tolist() == [128, 64, 256]
    assert found.loc["short"][["footprint", "footprint_low", "footprint_high"]].isna().all()
    assert set(found["footprint_measure"]) == {"agreement >= 0.9"} and "full" not in found.index
    by_score = critical_footprints(board, measure="score").set_index("method")  # 0.9 x the full cache's 80 = 72
    assert by_score.loc["steady", "footprint"] == 128 and math.isnan(by_score.loc["short", "footprint"])
    assert "informative score" in by_score.loc["steady", "footprint_measure"]


def test_the_footprint_columns_are_added_once_and_left_empty_on_the_full_cache():
    board = board_of([("full", None, 1.0, 1.0, 1.0, 80.0), ("steady", 64, 0.95, 0.91, 0.99, 78.0)])
    twice = add_footprint(add_footprint(board))
    assert list(twice.columns).count("footprint") == 1 and len(twice) == len(board)
    assert math.isnan(twice.loc[twice["method"] == "full", "footprint"].iloc[0])
    assert twice.loc[twice["method"] == "steady", "footprint"].iloc[0] == 64


def test_the_report_writes_the_footprint_into_the_leaderboard_csv_and_a_page(tmp_path):
    run = write(tmp_path / "run", noisy_predictions(4))
    report.render(run, resamples=50, plots=False)
    board = pd.read_csv(run / "leaderboard.csv")
    assert {"footprint", "footprint_low", "footprint_high", "footprint_measure"} <= set(board.columns)
    page = (run / "index.html").read_text(encoding="utf-8")
    assert "<script" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    report.render(run, resamples=50, plots=False, html=False)
    assert not (run / "index.html").exists()  # --no-html leaves no page behind that no longer matches


def test_page_data_has_every_row_with_n_and_the_worst_samples_with_both_answers(tmp_path):
    lines = noisy_predictions(4)
    for line in lines:
        line["prediction"] = f"{line['method']} says {line['score']}"
    run = write(tmp_path / "run", lines)
    report.render(run, resamples=50, plots=False)
    data = run_page_data(run)
    assert all(row["n"] == 12 for row in data["board"])  # 3 tasks x 4 samples, counted from the predictions
    keys = [c["key"] for c in data["columns"]]
    assert keys[:4] == ["method", "budget", "rank", "n"] and "footprint" in keys and "p_kl_vs_uniform_holm" in keys
    worst = data["methods"]["coin"]["worst"]
    assert len(worst) == 3 and worst[0]["kl"] >= worst[1]["kl"] >= worst[2]["kl"]
    assert worst[0]["full_answer"].startswith("full says") and worst[0]["prediction"].startswith("coin says")
    assert "ripplekv inspect --method 'coin'" in worst[0]["inspect"] and worst[0]["excerpt"] is None
    described = run_page_data(run, notes=method_notes())["methods"]["h2o"]
    assert "H2O" in described["about"] and described["defaults"] and described["reference"]  # docs/methods.md's row


def test_a_column_the_leaderboard_gains_later_is_shown_as_it_is(tmp_path):
    run = write(tmp_path / "run", noisy_predictions(2))
    report.render(run, resamples=50, plots=False)
    board = pd.read_csv(run / "leaderboard.csv").assign(small_sample=True)
    board.to_csv(run / "leaderboard.csv", index=False)
    assert "small_sample" in [c["key"] for c in run_page_data(run)["columns"]]


def test_the_inlined_data_cannot_close_its_script_element():
    hostile = "</script><script>alert(1)</script><!--"
    page = page_html({"kind": "site", "title": hostile, "pages": [{"path": hostile, "summary": "\u2028"}]})
    assert hostile not in page and page.count("</script>") == 2  # the data's and the code's own
    start = page.index('id="data">') + len('id="data">')
    data = json.loads(page[start:page.index("</script>", start)])
    assert data["pages"][0]["path"] == hostile


def ranks(rows):
    return pd.DataFrame(rows, columns=["method", "budget", "rank", "kl"])


def test_rankings_are_paired_over_the_methods_both_runs_have():
    a = ranks([("full", None, None, 0), ("p", 64, 1, 0.1), ("q", 64, 2, 0.2), ("r", 64, 3, 0.3), ("only_a", 64, 4, 0.4)])
    b = ranks([("full", None, None, 0), ("only_b", 64, 1, 0.01), ("r", 64, 2, 0.1), ("q", 64, 3, 0.2), ("p", 64, 4, 0.3)])
    pairs = paired_ranks(a, b).set_index("method")
    assert sorted(pairs.index) == ["p", "q", "r"]
    assert pairs.loc["p", ["rank_a", "rank_b", "change"]].tolist() == [1, 3, 2]  # re-ranked among the shared three
    assert pairs.loc["r", ["rank_a", "rank_b", "change"]].tolist() == [3, 1, -2]
    assert pairs.loc["p", "rank_b_run"] == 4  # its rank in B's own leaderboard is kept beside


def test_site_index_links_every_run_and_compare_refuses_to_overwrite_a_run(tmp_path, run_cli):
    root = tmp_path / "results"
    for name in ("eval", "gemma3/eval"):
        report.render(write(root / name, noisy_predictions(2)), resamples=50, plots=False, html=False)
    # the full cache alone (as the study's screen runs it): a headline with no rows, listed with no summary
    report.render(write(root / "screen", [r for r in noisy_predictions(2) if r["method"] == "full"]), resamples=50,
                  plots=False, html=False)
    (root / "profile").mkdir()  # not a run: not listed
    index = write_site(root)
    data = json.loads(index.read_text().split('id="data">')[1].split("</script>")[0])
    assert [p["link"] for p in data["pages"]] == ["eval/index.html", "gemma3/eval/index.html", "screen/index.html"]
    assert data["pages"][-1]["summary"] == "" and data["pages"][0]["summary"].startswith("closest to the full cache")
    shutil.rmtree(root / "screen")
    assert (root / "gemma3" / "eval" / "index.html").is_file()
    compared = write_compare_page(root / "eval", root / "gemma3" / "eval", root / "models")
    assert "rank_a" in compared.read_text() and "<title>ripplekv: eval vs gemma3/eval</title>" in compared.read_text()
    assert str(tmp_path) not in compared.read_text()  # paths relative to the page: the folder can move
    compared.unlink()
    data = json.loads(write_site(root).read_text().split('id="data">')[1].split("</script>")[0])
    assert data["pages"][-1]["kind"] == "compare" and compared.is_file()  # the site redraws it from compare.json
    assert data["pages"][-1]["summary"] == "rankings paired: eval vs gemma3/eval"
    code, _, err = run_cli("report", "--compare", str(root / "eval"), str(root / "gemma3" / "eval"), "--out",
                           str(root / "eval"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "holds a run" in err
    code, _, err = run_cli("report", "--site", str(root), str(root / "eval"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "give one of" in err


@pytest.fixture
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; `make install` does it as root)")
    opened = Browser(binary)
    try:
        yield opened
    finally:
        opened.close()


def png_pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=float)


@pytest.mark.slow
def test_the_page_works_in_headless_chromium_from_disk(tmp_path, browser):
    run = write(tmp_path / "run", noisy_predictions(4))
    report.render(run, resamples=50, plots=False)
    loaded = browser.open(run / "index.html")
    assert loaded == {"errors": [], "requests": []}  # no console error, nothing fetched beyond the file
    rows = "[...document.querySelectorAll('#leaderboard + div tbody tr')]"
    methods = f"{rows}.map(r => r.dataset.method)"
    before = browser.evaluate(methods)
    assert {"coin", "clone", "ahead", "h2o"} <= set(before)
    first_plot = "document.querySelector('.plot svg')"
    assert browser.evaluate(f"{first_plot}.querySelectorAll('.mark').length") == 5  # a point per method and budget
    browser.evaluate(f"{first_plot}.querySelector('.mark').dispatchEvent(new MouseEvent('mousemove', "
                     "{clientX: 50, clientY: 50}))")
    tip = browser.evaluate("document.getElementById('tip').hidden ? '' : document.getElementById('tip').textContent")
    assert all(word in tip for word in ("method:", "budget:", "n: 12", "kl:"))  # hover names them (4 x 3 tasks)
    browser.evaluate("[...document.querySelectorAll('#leaderboard + div th')].find(t => t.textContent === 'method').click()")
    after = browser.evaluate(methods)
    assert after == sorted(before) and after != before  # sorted by the method's name
    browser.evaluate("const f = document.getElementById('filter'); f.value = 'coin'; f.dispatchEvent(new Event('input'))")
    assert set(browser.evaluate(methods)) == {"full", "coin"}  # the full cache's row stays as the reference
    legend = browser.evaluate("[...document.querySelectorAll('.plot .legend')][0].textContent")
    assert "coin" in legend and "ahead" not in legend  # the plots follow the filter
    browser.evaluate("document.getElementById('filter').value = ''; document.getElementById('filter')"
                     ".dispatchEvent(new Event('input'))")
    pixels = png_pixels(browser.screenshot())
    assert pixels.shape[0] > 100 and pixels.std() > 10  # not a blank page
    (tmp_path / "page.png").write_bytes(browser.screenshot())
