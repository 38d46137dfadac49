"""Questions for the results pages of runs whose lines predate eval recording them (`report --site --questions`).

A page shows, beside the answers that diverged most, the sample's question. Eval keeps it on the full cache's
line now; an older run's samples are rebuilt here from its config.json (suite, tasks, limit, target tokens,
seed, model's tokenizer), exactly as eval built them, and only ids the run lists are kept. It loads a
tokenizer (seconds), so it is asked for, never done by a plain report.
"""

from __future__ import annotations

import json
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.pipeline.sample_lines import QUESTION_CHARS
from ripplekv.runs.files import CONFIG


def rebuilt_questions(run_dir: str | Path, tokenizers: dict | None = None) -> dict[str, str]:
    """sample id -> the start of its question, for the samples `run_dir`'s config.json lists; {} when the config
    cannot say how they were built. `tokenizers` caches one tokenizer per model across runs."""
    from ripplekv.engine.models import load_tokenizer
    from ripplekv.pipeline.evaluate import sample_id
    from ripplekv.tasks import get_tasks, load_samples

    try:
        config = json.loads((Path(run_dir) / CONFIG).read_text(encoding="utf-8"))
        suite, listed = config["suite"], config["samples"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    tokenizers = {} if tokenizers is None else tokenizers
    model = config.get("model")
    if model not in tokenizers:
        tokenizers[model] = load_tokenizer(model)
    questions = {}
    try:
        for task in get_tasks(suite, list(listed)):
            records = load_samples(task, tokenizers[model], limit=config.get("limit"), data_dir=config.get("data_dir"),
                                   target_tokens=config.get("target_tokens") or 3500, seed=config.get("seed") or 0)
            wanted = set(listed.get(task.name, []))
            for index, record in enumerate(records):
                sid = sample_id(record, index, task)
                if sid in wanted and str(record.get("input") or "").strip():
                    questions[sid] = str(record["input"]).strip()[:QUESTION_CHARS]
    except UserError:  # the suite's data is not on this machine: the page says the run carries no question
        return questions
    return questions
