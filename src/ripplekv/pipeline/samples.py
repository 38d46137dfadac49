"""One prompt to look at: a sample of a suite's task exactly as `eval` builds it, or a text file.

`ripplekv inspect` and the Python API (`ripplekv.sample_prompt`) share this, so a prompt compressed from
Python is token for token the one `eval` scored. The commands' prompts are also checked here against a
sliding-window model's window (`check_window`), before any model work, with advice the command can take.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError


@dataclass(frozen=True)
class Prompt:
    """Token ids of one prompt, where its question starts (the context-only boundary) and its gold answers."""

    ids: list[int]
    question_start: int
    answers: list[str]
    label: str
    task: object | None = None  # the Task a suite sample comes from (its max_new_tokens, stop rule)
    record: dict | None = None


def sample_prompt(tokenizer, task: str, index: int = 0, *, suite: str = "offline", data_dir: str | None = None,
                  target_tokens: int = 3500, max_length: int = 7500, seed: int = 0) -> Prompt:
    """Sample `index` of `task`, built as `eval` builds it with the same options."""
    from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples
    from ripplekv.tasks.prompts import question_start

    if index < 0:
        raise UserError(f"{{index}} must be >= 0, got {index}", "index")
    (chosen,) = get_tasks(suite, [task])
    records = load_samples(chosen, tokenizer, limit=index + 1, data_dir=data_dir, target_tokens=target_tokens,
                           seed=seed)
    if index >= len(records):
        raise UserError(f"task {chosen.name} has {len(records)} samples; {{index}} must be below that", "index")
    record = records[index]
    ids = build_prompt_ids(chosen, record, tokenizer, max_length)
    return Prompt(ids, question_start(chosen, record, tokenizer, max_length), list(record["answers"]),
                  f"{chosen.name} #{index}", chosen, record)


def file_prompt(tokenizer, path: str | Path) -> Prompt:
    """A text file read as the whole prompt (no question boundary, no answers)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    ids = list(tokenizer(path.read_text(encoding="utf-8", errors="replace")).input_ids)
    return Prompt(ids, len(ids), [], path.name)


@dataclass(frozen=True)
class PromptChoice:
    """Which one prompt to look at (`ripplekv inspect`): sample `index` of `task` in `suite`, built as `eval` builds
    it with `data_dir`, `target_tokens` and `max_length`; or, with `prompt_file`, that file's text."""

    task: str | None = None
    index: int = 0
    prompt_file: str | None = None
    suite: str = "offline"
    data_dir: str | None = None
    target_tokens: int = 3500
    max_length: int = 7500

    def build(self, tokenizer, max_length: int | None = None) -> Prompt:
        """The prompt (a suite sample cut at `max_length` when given, a trial length; else at the choice's)."""
        if self.prompt_file is not None:
            return file_prompt(tokenizer, self.prompt_file)
        return sample_prompt(tokenizer, self.task, self.index, suite=self.suite, data_dir=self.data_dir,
                             target_tokens=self.target_tokens,
                             max_length=self.max_length if max_length is None else max_length)


def model_window(model_spec) -> int | None:
    """The attention window every layer of a model is limited to (None for a hybrid model: its global layers
    read the whole prompt), from its config alone."""
    from ripplekv.engine.models import load_config

    return config_window(load_config(model_spec))


def config_window(config) -> int | None:
    """`model_window` of a config already read."""
    from ripplekv.engine.adapter import sliding_window

    return sliding_window(config)


def check_sliding_layers(config, methods: dict, decode_budget: str = "prompt", longest=None) -> None:
    """A model with sliding-window layers runs the methods that handle layers holding less than the prompt (all
    but those marked `sliding_layers = False`) under prompt budgets: the model evicts those layers itself while
    decoding. Refused in one line before any weights load. `longest()`: the longest prompt's tokens; where every
    sliding layer holds it whole, no layer holds less and those methods run (None: any prompt may be longer)."""
    from ripplekv.engine.adapter import has_sliding_layers, layer_capacities, layer_windows

    if not has_sliding_layers(config):
        return
    refused = [label for label, method in methods.items() if not getattr(method, "sliding_layers", True)]
    held = None
    if refused and longest is not None:
        length = longest()
        held = min(layer_capacities(length, layer_windows(config)))
        refused = [] if held >= length else refused
    if refused:
        where = "" if held is None else f" where a prompt ({length} tokens) is longer than a sliding layer holds ({held})"
        raise UserError(f"{', '.join(refused)} cannot run on a model with sliding-window layers{where} yet: "
                        "drop it from {methods} for this model" + (", or shorten the prompts" if held else ""), "methods")
    if decode_budget == "total":
        raise UserError("--decode-budget total is not supported on a model with sliding-window layers (the model "
                        "evicts those layers itself while decoding): use --decode-budget prompt")


def check_eval_sliding(config, methods: dict, work, tokenizer, max_length: int) -> None:
    """`eval`'s methods against the sliding-window layers of its model (`config`), once its samples are known: a
    method that cannot handle a layer holding less than the prompt runs where every prompt fits the window."""
    from ripplekv.tasks import build_prompt_ids

    check_sliding_layers(config, methods, longest=lambda: max(
        len(build_prompt_ids(task, record, tokenizer, max_length)) for task, _, record in work))


def check_window(window: int | None, longest, option: str, value: int, lowest: int) -> None:
    """Refuse, before any model work, prompts a model whose every layer slides cannot attend to whole (no layer
    reads the prompt's start): `longest(v)` is the longest prompt plus answer, chat template included, that the command
    builds with `option` set to v. The refusal names the largest value that fits, found by building again."""
    if window is None:
        return
    room = window - 1  # transformers' sliding cache keeps window - 1 prefilled entries: a prompt of `window` loses one
    total = longest(value)
    if total <= room:
        return
    why = (f"prompt plus answer is {total} tokens (chat template included) but this model attends only to its last "
           f"{window} (sliding_window={window}) in every layer, so no layer reads the prompt's start:")
    fit = value - (total - room)
    while fit >= lowest:
        built = longest(fit)
        if built <= room:
            raise UserError(f"{why} pass {option} {fit} or less")
        fit -= built - room
    shortest = longest(lowest)
    raise UserError(f"{why} no {option} fits (even {lowest} builds {shortest} tokens); use a model without a "
                    f"sliding window, or with one of at least {shortest} tokens")


def check_eval_window(config, work, tokenizer, max_length: int) -> None:
    """`eval`'s samples (task, id, record) against a sliding window (`config`: the model's), before the model loads
    or the run folder is made; the advice is a --max-length that fits every sample with its task's answer."""
    from ripplekv.tasks import build_prompt_ids

    window = config_window(config)
    if window is None:
        return

    def longest(length: int) -> int:
        return max(len(build_prompt_ids(task, record, tokenizer, length)) + task.max_new_tokens for task, _, record in work)

    check_window(window, longest, "--max-length", max_length, 2)


def check_calibration_window(model_spec, prompts, build, target_tokens: int, reserve: int = 0) -> None:
    """Calibration prompts (context + probe, plus `reserve` tokens decoded after them) against a sliding
    window; `build(target)` rebuilds them at another --target-tokens to find the largest that fits."""
    import contextlib
    import io

    from ripplekv.tasks.offline import MIN_TARGET_TOKENS

    window = model_window(model_spec)
    if window is None:
        return

    def longest(target: int) -> int:
        if target == target_tokens:
            built = prompts
        else:
            with contextlib.redirect_stderr(io.StringIO()):  # notes about trial builds are not the user's
                built = build(target)
        return max(len(p.context) + len(p.probe) for p in built) + reserve

    check_window(window, longest, "--target-tokens", target_tokens, MIN_TARGET_TOKENS)


def check_inspect_window(model_spec, prompt: PromptChoice, answer: bool) -> None:
    """`inspect --task`'s prompt (and, with `answer`, the answer it decodes) against a sliding window,
    before the model loads or the folder is made; the advice is a --max-length that fits."""
    from ripplekv.engine.models import load_tokenizer

    window = model_window(model_spec)
    if window is None:
        return
    tokenizer = load_tokenizer(model_spec)

    def longest(length: int) -> int:
        built = prompt.build(tokenizer, max_length=length)
        return len(built.ids) + (built.task.max_new_tokens if answer else 0)

    check_window(window, longest, "--max-length", prompt.max_length, 2)
