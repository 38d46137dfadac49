"""The RULER suite: NVIDIA's 13 synthetic tasks, as the `nvidia-long-context-eval` package defines them.

The package is the definition: its `synthetic.yaml` (each task's generator and arguments), its task templates
and answer prefixes (`data/synthetic/constants.py`), its generators (run by `tasks.ruler_package`) and its
scorers (`eval/synthetic/constants.py`, read by `metrics.ruler`). Nothing here re-derives a task.

- Length: `target_tokens` is RULER's `--max_seq_length`: the generator grows the haystack (sentences, words,
  documents) until the task text, counted with the model's own tokenizer, plus the task's generation length
  would pass it, so prompts land at or below it (niah's essay haystack grows by 500 words at a time, so its
  prompts can sit well below a short target). The model's chat template is added around the text, as RULER's
  `model_template_type` would; the answer prefix follows the chat template's assistant turn.
- Seeds: eval seed s runs the generator with RULER's seed 42 + 2s (s = 0 gives RULER's own samples),
  calibration with 43 + 2s, so the two splits never share a draw; RULER's QA tasks take questions in file
  order whatever the seed, so calibration QA starts at question `QA_CALIBRATION_START` (eval reads at most
  `MAX_SAMPLES` questions). Sample i depends only on the samples before it (RULER draws them in order).
- Records: the LongBench fields, with the task text cut at the boundaries its template marks (`head` before
  the context, `input` the question, `answer_prefix` after it) and niah's `depth` in percent: in `niah_depths`
  the depth asked for (RULER's measure, the share of the haystack's sentences before the needle), in the
  other niah tasks (whose depth RULER draws and does not return) where the asked value sits in the context's
  characters.
"""

from __future__ import annotations

import re
from functools import cache

from ripplekv.errors import UserError
from ripplekv.tasks import ruler_package

SUITE = "ruler"
DEFAULT_SIZES = {"eval": 20, "calibration": 8}
MAX_SAMPLES = 1000
QA_CALIBRATION_START = MAX_SAMPLES
MIN_TARGET_TOKENS = 1024  # RULER's shortest is 4k; below 1k its haystack steps are coarser than the target
MAX_TARGET_TOKENS = 131_072
PROMPT_TEMPLATE = "{head}{context}{input}"
# RULER's four categories (its paper), by generator.
CATEGORIES = {
    "niah": "Retrieval",
    "variable_tracking": "Multi-hop Tracing",
    "common_words_extraction": "Aggregation",
    "freq_words_extraction": "Aggregation",
    "qa": "Question Answering",
}
# Other names a task is known by: RULER's generator names for its one-task families.
ALIASES = {"variable_tracking": "vt", "common_words_extraction": "cwe", "freq_words_extraction": "fwe"}
# A task of ours built from RULER's: niah_single_2 with the needle at each depth in turn (sample i at
# DEPTH_ORDER[i % 11]), for the needle heatmap; named only on request (--tasks).
DEPTH_SWEEP = {"niah_depths": "niah_single_2"}
DEPTH_ORDER = (0, 100, 50, 20, 80, 40, 60, 10, 90, 30, 70)


@cache
def definitions() -> dict[str, dict]:
    """Task name -> {family, args, template, answer_prefix, tokens_to_generate, metric}, from the package."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as GENERATION
    from long_context_eval.eval.synthetic.constants import TASKS as SCORING

    path = ruler_package.package_dir() / "synthetic.yaml"
    try:
        tasks = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"cannot read RULER's task definitions {path}: {err}; reinstall nvidia-long-context-eval") from None
    out = {}
    for name, entry in tasks.items():
        family = entry["task"]
        out[name] = {
            "family": family,
            "args": dict(entry.get("args", {})),
            "template": GENERATION[family]["template"],
            "answer_prefix": GENERATION[family].get("answer_prefix", ""),
            "tokens_to_generate": int(GENERATION[family]["tokens_to_generate"]),
            "metric": SCORING[family]["metric_fn"].__name__,
        }
    for name, base in DEPTH_SWEEP.items():
        out[name] = {**out[base], "depth_sweep": True}
    return out


def available() -> bool:
    """Whether the package is installed (the suite is listed only then)."""
    try:
        ruler_package.package_dir()
    except UserError:
        return False
    return True


def task_names(opt_in: bool = False) -> list[str]:
    """RULER's 13 tasks in its order; with `opt_in`, ours built from them too."""
    return [name for name, d in definitions().items() if d.get("depth_sweep", False) == opt_in]


def category(name: str) -> str:
    return CATEGORIES[definitions()[name]["family"]]


# ---------------------------------------------------------------- one rendered sample -> a record


def _marker(text: str) -> str:
    """Leading whitespace and first word of a template piece: the literal every rendering of it starts with."""
    return re.match(r"\s*\S+", text).group(0)


def split_text(name: str, text: str) -> dict:
    """RULER's task text cut into `head` (instructions, and an in-context example where the task has one),
    `context`, `input` (the question) and `answer_prefix`, which join back into `text` exactly.

    Boundaries come from the task's template, searched from the end: the answer prefix's first word, then
    the question's (the text after `{context}`), then the end of the instructions before `{context}`."""
    d = definitions()[name]
    before, after = d["template"].split("{context}")
    head_end = before.rsplit("}", 1)[-1]  # the literal end of the instructions, after their last placeholder
    answer_at = text.rfind(_marker(d["answer_prefix"])) if d["answer_prefix"] else len(text)
    question_at = text.rfind(_marker(after), 0, answer_at)
    context_at = text.rfind(head_end, 0, question_at)
    if min(answer_at, question_at, context_at) < 0:
        raise UserError(f"RULER {name}: the generated text does not follow its template; "
                        "install nvidia-long-context-eval==26.3")
    context_at += len(head_end)
    return {"head": text[:context_at], "context": text[context_at:question_at],
            "input": text[question_at:answer_at], "answer_prefix": text[answer_at:]}


def needle_depth(context: str, answer: str) -> float | None:
    """Where the first gold value sits in the context, in percent of its characters (1 decimal)."""
    at = context.find(answer)
    return None if at < 0 or not context else round(100 * at / len(context), 1)


def generator_arguments(name: str, split: str, target_tokens: int, seed: int, num_samples: int,
                        pre_samples: int = 0) -> dict:
    """The options RULER's prepare.py passes the task's script (template: base model template + answer prefix)."""
    d = definitions()[name]
    arguments = {
        "save_dir": ".", "save_name": name, "tokenizer_path": "model", "tokenizer_type": "hf",
        "max_seq_length": target_tokens, "tokens_to_generate": d["tokens_to_generate"], "num_samples": num_samples,
        "random_seed": ruler_package.RULER_SEED + 2 * seed + (split == "calibration"),
        **d["args"],
        "template": d["template"] + d["answer_prefix"],
    }
    if d["family"] == "qa":
        arguments["pre_samples"] = pre_samples
    return arguments


def build_samples(task, tokenizer, *, split: str = "eval", limit: int | None = None, target_tokens: int = 4096,
                  seed: int = 0) -> list[dict]:
    """The first `limit` (default DEFAULT_SIZES[split]) samples of RULER task `task.name`, as records."""
    if not MIN_TARGET_TOKENS <= target_tokens <= MAX_TARGET_TOKENS:
        raise UserError(f"RULER prompts need a target length of {MIN_TARGET_TOKENS}-{MAX_TARGET_TOKENS} tokens "
                        f"(--target-tokens), got {target_tokens}")
    if seed < 0:
        raise UserError(f"--seed must be 0 or more for the RULER suite, got {seed}")
    n = DEFAULT_SIZES[split] if limit is None else limit
    if n > MAX_SAMPLES:
        raise UserError(f"the RULER suite builds at most {MAX_SAMPLES} samples per task; ask for {MAX_SAMPLES} or fewer")
    if n == 0:
        return []
    d = definitions()[task.name]
    pre = QA_CALIBRATION_START if split == "calibration" and d["family"] == "qa" else 0
    depths = [DEPTH_ORDER[i % len(DEPTH_ORDER)] for i in range(n)] if d.get("depth_sweep") else None
    made = ruler_package.generate(d["family"], generator_arguments(task.name, split, target_tokens, seed, n, pre),
                                  tokenizer, n, target_tokens, depths=depths)
    tag = f"s{seed}-" if seed else ""
    records = []
    for i, sample in enumerate(made):
        parts = split_text(task.name, sample["input"])
        answers = [str(a) for a in sample["outputs"]]
        record = {
            **parts,
            "answers": answers,
            "length": len(parts["context"].split()),
            "dataset": task.name,
            "language": "en",
            "all_classes": None,
            "_id": f"ruler-{task.name}-{tag}{split}-{i:04d}",
        }
        if depths is not None:  # RULER's own depth: the share of the haystack's sentences before the needle
            record["depth"] = float(depths[i])
        elif d["family"] == "niah":
            record["depth"] = needle_depth(parts["context"], answers[0])
        records.append(record)
    return records
