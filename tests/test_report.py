"""`ripplekv report` from a hand-made predictions file: task scores, averages, ranks, plots, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ripplekv.analysis import figures, report
from ripplekv.analysis.allocation import CROSS_FIT, HINDSIGHT, cross_fit

# task -> category; two categories so category averages differ from the overall average.
TASKS = {"niah": "Synthetic", "passage_count": "Synthetic", "squad": "Single-Doc QA"}
# (method, budget) -> (score of every sample of every task except squad, squad's score, KL to the full cache).
PLAN = {
    ("full", None): (1.0, 1.0, 0.0),
    ("snapkv", 64): (1.0, 0.5, 0.2),
    ("streamingllm", 64): (0.5, 0.5, 0.5),
    ("pyramidkv", 64): (1.0, 0.5, 0.2),  # ties with snapkv at 64
    ("snapkv", 128): (1.0, 1.0, 0.1),
    ("streamingllm", 128): (0.5, 0.0, 0.3),
    ("pyramidkv", 128): (0.0, 0.5, 0.4),
}


def predictions(samples_per_task: int = 2) -> list[dict]:
    out = []
    for task, category in TASKS.items():
        for i in range(samples_per_task):
            for (method, budget), (score, squad, kl) in PLAN.items():
                n = 300 + 100 * i
                out.append({
                    "id": f"{task}-{i}", "task": task, "category": category, "method": method, "budget": budget,
                    "prediction": "x", "answers": ["x"], "score": squad if task == "squad" else score,
                    "kept_entries": 8 * (budget or n), "kl": kl,
                    "agreement": 1.0 if method == "full" else 0.5, "prompt_tokens": n,
                    "layer_budgets": [n] * 4 if budget is None else [budget] * 4,
                })
    return out


def write(folder: Path, records: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (folder / "predictions.jsonl").write_text(text, encoding="utf-8")
    return folder


def test_task_scores_are_longbench_rounded_means(tmp_path):
    tables = report.render(write(tmp_path / "run", predictions()))
    scores = pd.read_csv(tmp_path / "run" / "scores.csv")
    assert list(scores.columns) == ["task", "category", "method", "budget", "n", "score", "kl", "agreement", "informative"]
    assert len(scores) == len(TASKS) * len(PLAN) and (scores["n"] == 2).all()
    row = scores[(scores.task == "squad") & (scores.method == "snapkv") & (scores.budget == 64)].iloc[0]
    assert row.score == 50.0 and row.kl == pytest.approx(0.2) and row.agreement == 0.5
    # The full cache answers "x" everywhere, as a constant answer would; only passage_count scores it (1.0) above
    # what "x" gets from its counting metric (0): the one informative task.
    assert scores.groupby("task")["informative"].first().to_dict() == {"niah": False, "passage_count": True, "squad": False}
    assert scores.loc[scores.method == "full", "budget"].isna().all()
    assert tables["scores"]["budget"].dtype == "Int64"


def test_leaderboard_averages_over_tasks_and_ranks_by_kl_within_each_budget(tmp_path):
    board = report.render(write(tmp_path / "run", predictions()))["leaderboard"]
    first = board.iloc[0]
    assert first["method"] == "full" and pd.isna(first["rank"]) and pd.isna(first["budget"])
    at64 = board[board["budget"] == 64].set_index("method")
    assert at64.loc["snapkv", "avg"] == round((100 + 100 + 50) / 3, 2)
    assert at64.loc["snapkv", "Synthetic"] == 100.0 and at64.loc["snapkv", "Single-Doc QA"] == 50.0
    assert at64.loc["snapkv", "rank"] == 1 and at64.loc["pyramidkv", "rank"] == 1  # ties share the better rank
    assert at64.loc["streamingllm", "rank"] == 3
    at128 = board[board["budget"] == 128]
    assert list(at128["method"]) == ["snapkv", "streamingllm", "pyramidkv"]  # closest to the full cache first
    assert list(at128["rank"]) == [1, 2, 3]
    assert board["budget"].dropna().is_monotonic_increasing
    assert list(board.columns[:9]) == ["method", "budget", "rank", "n", "fewer_samples", "kl", "kl_ci_low", "kl_ci_high",
                                      "agreement"]


def test_wide_table_has_one_column_per_task_grouped_by_category(tmp_path):
    report.render(write(tmp_path / "run", predictions()))
    wide = pd.read_csv(tmp_path / "run" / "leaderboard_wide.csv")
    assert list(wide.columns) == ["method", "budget", "niah", "passage_count", "squad", "avg"]
    board = pd.read_csv(tmp_path / "run" / "leaderboard.csv")
    assert list(wide["avg"]) == list(board["avg"])


def test_report_writes_plots_and_summary_and_ignores_a_partial_last_line(tmp_path, run_cli):
    run = write(tmp_path / "run", predictions(), tail='{"id": "niah-9", "task": "ni')
    code, out, err = run_cli("report", str(run))
    assert code == 0, err
    for name in ("score_vs_budget.png", "kl_vs_budget.png", "layer_budgets.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG"
    summary = (run / "summary.md").read_text()
    assert "| method | budget | rank | n | kl | kl 95% CI | agreement |" in summary and "6 samples over 3 tasks" in summary
    assert "B=64" in out and "streamingllm" in out


def test_typical_sample_is_the_median_prompt(tmp_path):
    frame = report.load_predictions(write(tmp_path / "run", predictions(samples_per_task=3)))
    task, sid = figures.typical_sample(frame)
    assert frame[(frame.task == task) & (frame.id == sid)]["prompt_tokens"].iloc[0] == 400


@pytest.mark.parametrize("content", [None, "", "\n"])
def test_missing_or_empty_predictions_is_one_line_exit_2(content, tmp_path, run_cli):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "predictions.jsonl").write_text(content)
    code, _, err = run_cli("report", str(run))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "predictions.jsonl" in err and "ripplekv eval" in err


def test_methods_with_identical_layer_budgets_share_one_labelled_line():
    from ripplekv.analysis.figures import shared_lines

    rows = pd.DataFrame({"method": ["streamingllm", "snapkv", "pyramidkv"],
                         "layer_budgets": [[64, 64], [64, 64], [80, 48]]})
    assert shared_lines(rows) == {(64, 64): ["streamingllm", "snapkv"], (80, 48): ["pyramidkv"]}


def test_a_shared_allocation_row_names_a_few_methods_and_counts_the_rest():
    from ripplekv.analysis.figures import _joined
    from ripplekv.analysis.forest import short_label

    names = ["streamingllm", "snapkv", "depthkv:allocation=runs/d.csv:scorer=snapkv", "adakv", "oracle"]
    assert _joined(names[:3], short_label) == "streamingllm = snapkv = depthkv:scorer=snapkv"
    assert _joined(names, short_label) == "streamingllm = snapkv = depthkv:scorer=snapkv (+2 more)"


# --------------------------------------------------------------------------- uncertainty


def noisy_predictions(samples_per_task: int = 10) -> list[dict]:
    """snapkv scores vary per sample; 'clone' copies it, 'ahead' beats it on every sample,
    'coin' is snapkv plus noise; budget 128 has no uniform baseline."""
    out = []
    for t, (task, category) in enumerate(TASKS.items()):
        for i in range(samples_per_task):
            base = ((7 * i + 3 * t) % 10) / 10
            plan = {("full", None): 1.0, ("snapkv", 64): base, ("clone", 64): base,
                    ("ahead", 64): min(1.0, base + 0.2), ("coin", 64): abs(base - 0.1 * ((i + t) % 3 - 1)),
                    ("h2o", 128): base}
            for (method, budget), score in plan.items():
                out.append({"id": f"{task}-{i}", "task": task, "category": category, "method": method,
                            "budget": budget, "score": score, "kl": 0.0 if budget is None else (1 - score) / 2,
                            "agreement": 0.9, "prompt_tokens": 300 + i, "length": 200 + i,
                            "layer_budgets": [budget or 300 + i] * 4})
    return out


def test_leaderboard_has_intervals_differences_permutation_and_holm_p_values(tmp_path):
    run = write(tmp_path / "run", noisy_predictions())
    report.render(run)
    board = pd.read_csv(run / "leaderboard.csv")
    for column in ("kl_ci_low", "kl_ci_high", "agreement_ci_low", "kl_delta_vs_uniform", "p_kl_vs_uniform",
                   "p_kl_vs_uniform_holm", "kl_verdict", "kl_mdd", "kl_ratio_vs_uniform", "avg_informative",
                   "avg_informative_ci_low", "delta_vs_uniform", "delta_ci_low", "delta_ci_high", "p_vs_uniform",
                   "p_vs_uniform_holm", "verdict", "score_mdd", "avg_ci_low", "avg_ci_high", "informative_tasks"):
        assert column in board.columns
    assert ((board.avg_ci_low <= board.avg) & (board.avg <= board.avg_ci_high)).all()
    assert ((board.kl_ci_low <= board.kl) & (board.kl <= board.kl_ci_high)).all()
    assert (board.avg_ci_high - board.avg_ci_low > 1).sum() >= 4  # real spread, not a point
    rows = board.set_index(["method", "budget"], drop=False)
    clone, ahead, coin = rows.loc[("clone", 64)], rows.loc[("ahead", 64)], rows.loc[("coin", 64)]
    assert clone.delta_vs_uniform == 0 and clone.delta_ci_low <= 0 <= clone.delta_ci_high and clone.p_vs_uniform == 1
    assert ahead.delta_vs_uniform > 0 and ahead.delta_ci_low > 0 and ahead.p_vs_uniform_holm < 0.05
    assert ahead.verdict == "better" and clone.verdict == "tied" and coin.verdict == "tied"
    assert coin.delta_ci_low < 0 < coin.delta_ci_high
    at64 = board[board.budget == 64]
    # Holm over the table's three comparisons: each adjusted p at least its raw p, and the smallest tripled.
    assert (at64.p_vs_uniform_holm.dropna() >= at64.p_vs_uniform.dropna()).all()
    assert at64.p_vs_uniform_holm.min() == pytest.approx(min(1.0, 3 * at64.p_vs_uniform.min()))
    assert rows.loc[("snapkv", 64)].delta_vs_uniform == 0 and rows.loc[("snapkv", 64)].verdict == "baseline"
    full = board[board.method == "full"].iloc[0]
    assert pd.isna(full.delta_vs_uniform) and pd.isna(full.p_vs_uniform) and full.avg_ci_low == full.avg == 100
    assert board.loc[board.budget == 128, ["delta_vs_uniform", "p_vs_uniform"]].isna().all().all()  # no baseline
    # KL (lower is better) gets the same paired treatment: 'ahead' is closer to the full cache on every sample.
    assert clone.kl_delta_vs_uniform == 0 and clone.p_kl_vs_uniform == 1 and clone.kl_ratio_vs_uniform == 1
    assert ahead.kl_delta_ci_high < 0 and ahead.p_kl_vs_uniform_holm < 0.05 and ahead.kl_verdict == "closer"
    assert 0 < ahead.kl_ratio_ci_low < ahead.kl_ratio_vs_uniform < ahead.kl_ratio_ci_high < 1
    assert (at64.kl_mdd.dropna() >= 0).all() and ahead.kl_mdd > 0 and clone.kl_mdd == 0  # a clone has no spread
    settings = json.loads((run / "report.json").read_text())
    assert "ahead vs snapkv at B=64" in settings["primary_comparisons"] and settings["adjustment"].startswith("Holm")


def test_a_run_can_declare_its_primary_baseline(tmp_path):
    run = write(tmp_path / "run", noisy_predictions())
    (run / "config.json").write_text(json.dumps({"primary_baseline": "clone"}))
    board = report.render(run)["leaderboard"].set_index(["method", "budget"])
    assert board.loc[("snapkv", 64), "versus"] == "clone" and board.loc[("clone", 64), "verdict"] == "baseline"
    assert board.loc[("h2o", 128), "versus"] is None or pd.isna(board.loc[("h2o", 128), "versus"])


def test_uniform_is_the_baseline_when_present(tmp_path):
    records = noisy_predictions()
    records += [{**r, "method": "uniform", "score": 0.0} for r in records if r["method"] == "snapkv"]
    board = report.render(write(tmp_path / "run", records))["leaderboard"].set_index("method")
    assert board.loc["snapkv", "delta_vs_uniform"] == board.loc["snapkv", "avg"] > 0
    assert board.loc["uniform", "delta_vs_uniform"] == 0


def test_ranks_csv_and_determinism(tmp_path):
    records = noisy_predictions()
    first = write(tmp_path / "a", records)
    report.render(first)
    ranks = pd.read_csv(first / "ranks.csv")
    assert list(ranks.columns) == ["method", "budget", "p_rank1", "expected_rank"]
    assert ranks.groupby("budget")["p_rank1"].sum().round(9).eq(1).all()
    at64 = ranks[ranks.budget == 64].set_index("method")
    assert at64.loc["ahead", "p_rank1"] > 0.9 and at64.loc["ahead", "expected_rank"] < 1.1
    assert ranks[ranks.budget == 128].iloc[0].tolist() == ["h2o", 128, 1.0, 1.0]
    # Rendered again: byte-identical. The same lines in another order: the same numbers (rows and
    # columns follow first appearance, so compare them sorted).
    again = write(tmp_path / "again", records)
    report.render(again)
    for name in ("leaderboard.csv", "ranks.csv", "lengths.csv", "summary.md"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    shuffled = write(tmp_path / "shuffled", list(reversed(records)))
    report.render(shuffled)

    def table(folder, name):
        frame = pd.read_csv(folder / name)
        return frame.sort_values(["method", "budget"]).reset_index(drop=True).sort_index(axis=1)

    for name in ("leaderboard.csv", "ranks.csv"):
        pd.testing.assert_frame_equal(table(first, name), table(shuffled, name))
    report.render(again, seed=1)  # the bootstrap's seed moves the rank probabilities; every p here is exact
    assert (first / "ranks.csv").read_bytes() != (again / "ranks.csv").read_bytes()
    assert (first / "leaderboard.csv").read_bytes() == (again / "leaderboard.csv").read_bytes()


def test_summary_and_table_mark_only_significant_differences(tmp_path, run_cli):
    run = write(tmp_path / "run", noisy_predictions())
    code, out, err = run_cli("report", str(run), "--resamples", "500")
    assert code == 0, err
    summary = (run / "summary.md").read_text()
    lines = {line.split(" | ")[1]: line for line in summary.splitlines() if line.startswith("| 64 | ")}
    assert "| closer |" in lines["ahead"] and "| better |" in lines["ahead"]
    assert "| tied |" in lines["coin"] and "| tied |" in lines["clone"] and "| baseline |" in lines["snapkv"]
    assert "500 paired bootstrap resamples" in summary and "Holm" in summary and "Minimum detectable difference" in summary
    assert summary.index("## Headline") < summary.index("## Leaderboard")
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "▲" in rows["ahead"] and not {"▲", "▼"} & set(rows["coin"] + rows["clone"] + rows["snapkv"])
    assert json.loads((run / "report.json").read_text())["resamples"] == 500


def test_the_headline_names_the_runner_up_and_calls_a_tie_a_tie(tmp_path):
    headline = report.render(write(tmp_path / "run", noisy_predictions()))["headline"]
    at64 = headline[(headline.scope == "all methods") & (headline.budget == 64)].iloc[0]
    # 'ahead' has the lowest KL; snapkv and its exact clone tie for second, so the runner-up is the first of them.
    assert at64.closest == "ahead" and at64.runner_up in {"snapkv", "clone", "coin"}
    assert at64.kl_delta < 0 and at64.kl_ci_high < 0 and at64.kl_verdict == "closer"
    at128 = headline[headline.budget == 128]
    assert at128.empty  # one method at B=128: no runner-up, no headline line
    tie = noisy_predictions()
    tie = [r for r in tie if r["method"] in ("full", "snapkv", "clone")]
    table = report.render(write(tmp_path / "tie", tie))["headline"].iloc[0]
    assert table.kl_delta == 0 and table.kl_ci_low <= 0 <= table.kl_ci_high and table.kl_verdict == "tied"
    assert table.score_verdict == "tied" and table.p_kl == 1


def test_length_buckets_longbench_e_and_non_overlapping_token_thirds(tmp_path):
    longbench_e = {"niah": "hotpotqa_e", "passage_count": "passage_count_e", "squad": "qasper_e"}
    records = [{**r, "task": longbench_e[r["task"]], "length": [1000, 5000, 9000][int(r["id"][-1]) % 3]}
               for r in noisy_predictions(samples_per_task=6)]
    lengths = report.render(write(tmp_path / "e", records))["lengths"]
    full = lengths[lengths.method == "full"]
    assert full["bucket"].tolist() == ["0-4k", "4-8k", "8k+"] and full["samples"].tolist() == [6, 6, 6]
    assert (full["unit"] == "words").all()
    assert "## By context length" in (tmp_path / "e" / "summary.md").read_text()
    # Other suites: the samples' prompt tokens cut at their 1/3 and 2/3 quantiles; each task's samples here have
    # 300-305 tokens, so the cut falls at the same tokens in every task and the ranges never overlap.
    records = noisy_predictions(samples_per_task=6)
    for r in records:
        r["prompt_tokens"] += 40 * (r["task"] == "squad")  # squad's prompts are longer: they fill the long bucket
    lengths = report.render(write(tmp_path / "offline", records))["lengths"]
    row = lengths[(lengths.method == "snapkv")].set_index("bucket")
    assert list(row.index) == ["short", "medium", "long"] and (row["unit"] == "prompt tokens").all()
    assert row.loc["short", "length_max"] < row.loc["medium", "length_min"] <= row.loc["medium", "length_max"] < row.loc["long", "length_min"]
    assert row["samples"].sum() == 18 and row.loc["long", "tasks"] == 1
    plain = [{k: v for k, v in r.items() if k != "length"} for r in noisy_predictions(3)]  # tokens are enough
    assert set(report.render(write(tmp_path / "plain", plain))["lengths"]["bucket"]) == {"short", "medium", "long"}


def test_report_rouge_score_rescores_summaries(tmp_path, run_cli):
    records = [{**r, "task": "gov_report", "category": "Summarization", "prediction": "the cats were running",
                "answers": ["The cat was run"]} for r in noisy_predictions(2) if r["task"] == "niah"]
    run = write(tmp_path / "run", records)
    code, _, err = run_cli("report", str(run), "--rouge", "rouge-score")
    assert code == 0, err
    assert set(pd.read_csv(run / "scores.csv")["score"]) == {75.0}
    assert json.loads((run / "report.json").read_text())["rouge"] == "rouge-score"
    assert "rouge-score" in (run / "summary.md").read_text()
    code, _, _ = run_cli("report", str(run))
    assert code == 0 and set(pd.read_csv(run / "scores.csv")["score"]) != {75.0}


@pytest.mark.parametrize("args, message", [(["--rouge", "nope"], "Invalid value for '--rouge': 'nope' is not one of 'official', 'rouge-score'."),
                                           (["--resamples", "0"], "--resamples must be a positive number")])
def test_bad_report_options_are_one_line(tmp_path, run_cli, args, message):
    run = write(tmp_path / "run", noisy_predictions(2))
    code, _, err = run_cli("report", str(run), *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_inspect_writes_the_kept_entries_and_a_picture(tiny_model_dir, tmp_path, monkeypatch, run_cli):
    import numpy as np

    out = tmp_path / "inspect"
    args = ["inspect", "--model", str(tiny_model_dir), "--suite", "offline", "--task", "niah", "--index", "0",
            "--method", "snapkv:window=8", "--budget", "32", "--target-tokens", "300"]
    code, _, err = run_cli(*args, "--out", str(out))
    assert code == 0, err
    monkeypatch.chdir(tmp_path)  # without --out: runs/inspect, as every command writes under runs/ by default
    code, _, err = run_cli(*args)
    assert code == 0 and err.startswith("inspect: writing to runs/inspect (the default; choose with --out)"), err
    assert np.load(tmp_path / "runs" / "inspect" / "kept.npz")["positions"].tolist() == np.load(out / "kept.npz")["positions"].tolist()
    kept = np.load(out / "kept.npz")
    counts, positions = kept["counts"], kept["positions"]
    assert counts.shape == (4, 2) and (counts == 32).all()
    n = int(json.loads(str(kept["meta"]))["prompt_tokens"])
    assert ((positions >= 0) & (positions < n)).sum() == 4 * 2 * 32
    assert (positions[:, :, -8:] == np.arange(n - 8, n)).all()  # the window is always kept
    assert 0 < int(kept["question_start"]) < n and len(kept["answer_positions"]) > 0
    assert (out / "kept.png").stat().st_size > 10_000
    code, _, err = run_cli("inspect", "--model", str(tiny_model_dir), "--method", "snapkv", "--budget", "32",
                           "--out", str(out))
    assert code == 2 and "--task" in err and len(err.strip().splitlines()) == 1


def test_forest_rows_sort_best_first_and_leave_answer_aware_variants_out(tmp_path):
    """The forest plot's rows: paired comparisons with the baseline, best first, KL as a ratio to the baseline's;
    answer-aware variants are no rows and no lines (no bounds); the full cache is no row."""
    from ripplekv.analysis.forest import forest_rows, plot_forest, ratio_ticks, short_label

    board = pd.DataFrame({
        "method": ["full", "snapkv", "ripplekv", "knorm", "oracle"],
        "budget": [None, 64, 64, 64, 64],
        "versus": [None, "snapkv", "snapkv", "snapkv", "snapkv"],
        "kl": [0.0, 0.5, 0.4, 2.5, 0.05],
        "kl_ratio_vs_uniform": [None, 1.0, 0.8, 5.0, 0.1],
        "kl_ratio_ci_low": [None, 1.0, 0.7, 4.0, 0.05],
        "kl_ratio_ci_high": [None, 1.0, 0.9, 6.0, 0.2],
        "p_kl_vs_uniform_holm": [None, None, 0.01, 0.001, 0.001],
        "delta_vs_uniform": [None, 0.0, 2.0, -10.0, 9.0],
        "delta_ci_low": [None, 0.0, -1.0, -14.0, 5.0],
        "delta_ci_high": [None, 0.0, 5.0, -6.0, 12.0],
        "p_vs_uniform_holm": [None, None, 0.6, 0.01, 0.01],
    })
    rows, base = forest_rows(board, 64, "kl")
    assert base == "snapkv" and list(rows["method"]) == ["ripplekv", "snapkv", "knorm"]
    assert rows["delta"].tolist() == [0.8, 1.0, 5.0]
    rows, _ = forest_rows(board, 64, "score")
    assert list(rows["method"]) == ["ripplekv", "snapkv", "knorm"]
    assert ratio_ticks(0.7, 6.0) == [1.0, 2.0, 4.0]
    assert ratio_ticks(0.75, 1.3) == [0.8, 1.0, 1.25]  # a short axis gets the finer steps
    assert short_label("depthkv:allocation=runs/a/depthkv.csv:scorer=snapkv") == "depthkv:scorer=snapkv"
    assert short_label("compresskv:profile=compresskv.csv") == "compresskv" and short_label("snapkv:window=16") == "snapkv:window=16"
    for measure in ("kl", "score"):
        plot_forest(board, tmp_path / f"{measure}.png", measure)
        assert (tmp_path / f"{measure}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_series_has_its_own_colour_and_marker():
    from ripplekv.analysis.plots import AWARE_COLOUR, PALETTE, series_styles

    labels = [f"method{i}" for i in range(40)]
    styles = series_styles(labels)
    looks = [(s.colour, s.marker) for s in styles.values()]
    assert len(set(looks)) == len(looks)  # no two series share colour and marker
    assert len({(s.colour, s.marker, s.line, s.hollow) for s in styles.values()}) == len(looks)
    for first, second in zip(looks, looks[1:]):  # neighbours differ in both
        assert first[0] != second[0] and first[1] != second[1]
    assert AWARE_COLOUR not in PALETTE  # grey is kept for answer-aware variants
    same_colour = [s for s in styles.values() if s.colour == PALETTE[0]]
    assert len({(s.marker, s.line, s.hollow) for s in same_colour}) == len(same_colour)


# --------------------------------------------------------------------------- the allocation-only table


def test_allocation_table_pairs_every_allocator_with_the_baselines_scorer_against_uniform(tmp_path):
    """Methods sharing uniform's scorer (per config.json's resolved specs) are paired against it, each with its share
    of the gap to the best of the *other* allocations; methods with another scorer (streamingllm, the oracle) are
    left out; the answer-aware allocation is a row of its own kind, the hindsight best-of a bound with no test."""
    snap = {"name": "snapkv", "window": 32, "kernel": 7, "pooling": "max"}
    specs = {"full": {"preset": "full"}, "uniform": {"allocator": {"name": "uniform"}, "scorer": snap},
             "pyramidkv": {"allocator": {"name": "pyramid"}, "scorer": snap},
             "lava:scorer=snapkv": {"allocator": {"name": "lava"}, "scorer": snap},
             "allocation-ceiling": {"allocator": {"name": "answer"}, "scorer": snap},
             "snapkv:window=16": {"allocator": {"name": "uniform"}, "scorer": {**snap, "window": 16}},
             "streamingllm": {"allocator": {"name": "uniform"}, "scorer": {"name": "recency", "sinks": 4}},
             "oracle": {"allocator": {"name": "uniform"}, "scorer": {"name": "oracle", "window": 0}}}
    kl = {"uniform": 0.8, "pyramidkv": 0.7, "lava:scorer=snapkv": 0.5, "allocation-ceiling": 0.4,
          "snapkv:window=16": 0.9, "streamingllm": 1.5, "oracle": 0.1}
    records = []
    for task, category in TASKS.items():
        for i in range(6):
            for method in specs:
                for budget in ([None] if method == "full" else [64, 128]):
                    shift = 0.0 if method == "full" else kl[method] * 64 / budget
                    records.append({"id": f"{task}-{i}", "task": task, "category": category, "method": method,
                                    "budget": budget, "prediction": "x", "answers": ["x"],
                                    "score": max(0.0, 1.0 - shift + 0.05 * (i % 3)), "kl": shift + 0.01 * i,
                                    "agreement": 1.0, "prompt_tokens": 300, "layer_budgets": [budget or 300] * 4})
    run = write(tmp_path / "run", records)
    (run / "config.json").write_text(json.dumps({"method_specs": specs, "answer_aware": ["allocation-ceiling", "oracle"]}))
    tables = report.render(run, resamples=300)
    table = tables["allocation"]
    assert set(table["method"]) == {"uniform", "pyramidkv", "lava:scorer=snapkv", "allocation-ceiling", HINDSIGHT, CROSS_FIT}
    assert len(table) == 12 and "score_gap_closed" not in table and "kl_gap_closed" not in table
    rows = table.set_index(["method", "budget"])
    assert (rows.xs("allocation-ceiling", level=0)["kind"] == "answer-aware").all()
    assert (rows.xs(HINDSIGHT, level=0)["kind"] == "hindsight bound").all()
    for budget in (64, 128):
        u, lava = rows.loc[("uniform", budget)], rows.loc[("lava:scorer=snapkv", budget)]
        bound, aware = rows.loc[(HINDSIGHT, budget)], rows.loc[("allocation-ceiling", budget)]
        # the answer-aware allocation is best on every sample here, so the hindsight best-of is it
        assert bound.kl == pytest.approx(aware.kl) and pd.isna(bound.p_kl_vs_uniform) and pd.isna(bound.kl_gap_share)
        # leave-one-out: lava's best of the others is the answer-aware allocation; that one's is lava
        assert lava.kl_best_of_others == pytest.approx(aware.kl) and aware.kl_best_of_others == pytest.approx(lava.kl)
        assert lava.kl_gap_share == pytest.approx((u.kl - lava.kl) / (u.kl - aware.kl)) == pytest.approx(0.75)
        assert aware.kl_gap_share == pytest.approx((u.kl - aware.kl) / (u.kl - lava.kl)) and aware.kl_gap_share > 1
        assert pd.isna(u.kl_delta_vs_uniform) and u.kl_gap_share == pytest.approx(0.0) and u.kl_verdict == "baseline"
        assert lava.kl_delta_vs_uniform == pytest.approx(lava.kl - u.kl)
        assert lava.kl_delta_ci_low <= lava.kl_delta_vs_uniform <= lava.kl_delta_ci_high < 0  # every sample closer
        assert lava.kl_verdict == "closer" and aware.kl_verdict == "answer-aware"
        # the cross-fitted choice never picks the answer-aware allocation: lava, chosen on each half, both ways
        cross = rows.loc[(CROSS_FIT, budget)]
        assert cross.picks == "lava:scorer=snapkv (both halves)" and cross.kl == pytest.approx(lava.kl)
    with_p = table[table["p_kl_vs_uniform"].notna()]
    assert len(with_p) == 8 and (with_p["p_kl_vs_uniform_holm"] >= with_p["p_kl_vs_uniform"]).all()
    saved = pd.read_csv(run / "allocation_only.csv")
    assert len(saved) == 12 and {"kl_gap_share", "p_kl_vs_uniform_holm", "p_vs_uniform_holm", "kind"} <= set(saved.columns)
    text = (run / "allocation_only.md").read_text()
    assert "allocation-ceiling (answer-aware)" in text and "75%" in text and "ceiling)" not in text
    assert "streamingllm" not in text and "| oracle" not in text and f"{HINDSIGHT} (hindsight bound)" in text
    headline = tables["headline"]
    alone = headline[headline["scope"] == "allocation only"].set_index("budget")
    assert (alone["closest"] == "lava:scorer=snapkv").all() and (alone["runner_up"] == "pyramidkv").all()
    (run / "config.json").write_text(json.dumps({"method_specs": {"full": specs["full"], "uniform": specs["uniform"]}}))
    assert report.render(run, resamples=50)["allocation"] is None  # one allocator alone: no table


def test_the_cross_fit_choice_is_made_on_one_half_and_judged_on_the_other():
    """Allocator a is best on even samples, b on odd ones: chosen on the evens, a is judged on the odds, and the
    other way round; the answer-aware row is never eligible."""
    from ripplekv.analysis.inference import Samples

    kl = np.array([[0.1, 0.9, 0.1, 0.9], [0.9, 0.1, 0.9, 0.1], [0.0, 0.0, 0.0, 0.0]])
    values = Samples(kl, np.zeros(4, dtype=int), [("t", i) for i in range(4)])
    picks, kl_out, score_out = cross_fit(values, values, [True, True, False], ["a", "b", "aware"])
    assert picks == "a / b" and kl_out.tolist() == [0.9, 0.9, 0.9, 0.9]


def test_report_on_a_run_an_eval_is_writing_names_the_eval_and_offers_no_out(tmp_path, run_cli):
    """The lock's holder writes who it is: `report` then says an eval holds the run, and only to wait (it has no --out)."""
    from ripplekv.runs.safeio import exclusive

    run = tmp_path / "run"
    run.mkdir()
    (run / "predictions.jsonl").write_text("")
    with exclusive(run, "eval"):
        code, _, err = run_cli("report", run)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: another ripplekv eval is writing to {run} (pid ") and "--out" not in err, err
    assert err.rstrip().endswith("; wait for it to finish")
    code, _, err = run_cli("report", run)  # the lock is free again: the empty run is what is said now
    assert code == 2 and "another" not in err


def test_a_run_of_the_full_cache_alone_reports_without_figures(tmp_path, run_cli):
    """A task screen evaluates the full cache only: the report must still write its tables (the informative
    verdict is what the screen reads) and leave out the figures of compressed variants, not crash on them."""
    records = [r for r in predictions() if r["method"] == "full"]
    run = write(tmp_path / "run", records)
    code, out, err = run_cli("report", str(run))
    assert code == 0, err
    informative = pd.read_csv(run / "informative.csv")
    assert set(informative["task"]) == set(TASKS)
    assert not any((run / name).exists() for name in report.FIGURES)


def test_a_row_with_fewer_samples_has_its_n_is_listed_apart_and_is_never_ranked(tmp_path):
    records = [r for r in predictions(3) if not (r["method"] == "pyramidkv" and r["budget"] == 128 and r["id"].endswith("-2"))]
    run = write(tmp_path / "run", records)
    tables = report.render(run, plots=False)
    board = tables["leaderboard"].set_index(["method", "budget"])
    short = board.loc[("pyramidkv", 128)]
    assert short["n"] == 6 and short["fewer_samples"] and pd.isna(short["rank"])
    assert board.loc[("snapkv", 128), "n"] == 9 and not board.loc[("snapkv", 128), "fewer_samples"]
    assert list(board.xs(128, level="budget")["rank"].dropna()) == [1, 2]  # the two 9-sample rows only
    ranks = tables["ranks"]
    assert "pyramidkv" not in set(ranks.loc[ranks["budget"] == 128, "method"])
    summary = (run / "summary.md").read_text()
    leaderboard, apart = summary.split("Rows with fewer samples than the table's n (9), not ranked:")
    assert "| pyramidkv | 128 |" in apart.split("##")[0] and "| pyramidkv | 128 |" not in leaderboard.split("## Leaderboard")[1]


def test_forest_rows_leave_out_rows_with_fewer_samples():
    from ripplekv.analysis.forest import forest_rows

    board = pd.DataFrame({"method": ["snapkv", "ripplekv", "kivi:bits=2"], "budget": [256, 256, 256],
                          "versus": ["snapkv"] * 3, "fewer_samples": [False, False, True],
                          "kl_ratio_vs_uniform": [1.0, 0.8, 0.3], "kl_ratio_ci_low": [1.0, 0.7, np.nan],
                          "kl_ratio_ci_high": [1.0, 0.9, np.nan], "p_kl_vs_uniform_holm": [np.nan, 0.01, 1.0]})
    rows, _ = forest_rows(board, 256, "kl")
    assert list(rows["method"]) == ["ripplekv", "snapkv"]  # the 1-sample row's lower ratio is not drawn first


def test_a_variant_over_its_budget_is_flagged_and_never_ranked_against_exact_ones(tmp_path):
    """A variant that keeps more bytes than its budget stands for (`lukv:rounding=kvpress`'s drift) came first
    by KL: it is flagged `over_budget`, left out of ranks, verdicts and the headline, and named in summary.md;
    the exact methods rank among themselves."""
    records = []
    for line in noisy_predictions():
        exact = 4 * 2 * 64 * 128
        if line["budget"] is not None:  # every eval line says what it kept and what its budget stands for
            line = {**line, "kv_bytes": exact, "kv_budget_bytes": exact}
        records.append(line)
        if line["method"] == "ahead":  # the closest of all, on more memory than budget 64 allows
            records.append({**line, "method": "loose", "kl": line["kl"] / 4, "kv_bytes": exact + 512})
    run = write(tmp_path / "run", records)
    tables = report.render(run)
    board = pd.read_csv(run / "leaderboard.csv").set_index("method")
    assert bool(board.loc["loose", "over_budget"]) and not board.loc[["snapkv", "ahead", "clone"], "over_budget"].any()
    assert pd.isna(board.loc["loose", "rank"]) and board.loc["ahead", "rank"] == 1
    assert board.loc["loose", "kl_verdict"] == "over budget" and board.loc["loose", "verdict"] == "over budget"
    assert "loose" not in set(tables["ranks"]["method"])
    headline = pd.read_csv(run / "headline.csv")
    assert "loose" not in set(headline["closest"]) | set(headline["runner_up"])
    summary = (run / "summary.md").read_text()
    assert "Over budget: `loose`" in summary and "| rank | over budget |" in summary
