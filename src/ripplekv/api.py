"""ripplekv from Python: compress a prompt's KV cache with any method and generate from it with
`model.generate`, compare methods on your own text from one prefill, list and check methods, and read
a run's files as DataFrames.

These are the functions the CLI runs, not a second implementation: a cache made here keeps exactly the
entries `ripplekv eval` scores (L x H_kv x B, with real per-head lengths, not masks), and `generate` is
eval's own per-sample function. Mistakes a caller can fix raise `ripplekv.UserError` with the one-line
message the CLI prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch

from ripplekv.defaults import EVAL_BATCH_SIZE
from ripplekv.engine.cache import CompressedCache
from ripplekv.errors import UserError
from ripplekv.methods.core.base import Method
from ripplekv.methods.core.catalog import MethodInfo, catalog
from ripplekv.pipeline.samples import Prompt, sample_prompt
from ripplekv.runs.tables import Run, load_run

__all__ = ["Answer", "CompressedPrompt", "MethodInfo", "Prompt", "Run", "UserError", "compress", "generate",
           "list_methods", "load_model", "load_run", "method", "sample_prompt"]

NO_TRUNCATION = 2**62  # user text is never cut in the middle; a prompt too long for the model is refused


def load_model(model: str | None = None, *, device: str = "auto", dtype: str = "auto"):
    """`(model, tokenizer)` as every command's `--model` loads them: a hub id, a model directory or a
    `.gguf`; by default the bundled SmolLM2-135M-Instruct (offline, dequantized once)."""
    from ripplekv.engine.models import load_model as load

    loaded, tokenizer, _ = load(model, device=device, dtype=dtype)
    return loaded, tokenizer


def list_methods() -> list[MethodInfo]:
    """Every named method with its allocator, scorer and options' defaults (`ripplekv methods` as data).

    Not `ripplekv.methods()`: `ripplekv.methods` is the package of the methods themselves."""
    return catalog()


def method(spec: str, **options) -> Method:
    """A checked method from a spec (`"pyramidkv:beta=10"`) and options (`window=16`, `allocation="a.csv"`).

    Use it to validate a spec before any model work; an unknown name or option raises UserError."""
    from ripplekv.methods import make_method

    if not isinstance(spec, str):
        raise UserError(f"a method spec is a string such as 'snapkv:window=16', got {type(spec).__name__}")
    return make_method(spec, **options)


class CompressedPrompt(CompressedCache):
    """A transformers `Cache` holding one prompt's compressed entries, for `model.generate(past_key_values=...)`.

    `input_ids` [1, n + 1] is the prompt followed by the token full attention predicts after it (the
    prefill's, as in eval): `model.generate(cache.input_ids, past_key_values=cache)` continues from there,
    so its answer is `output[0, cache.prompt_length:]`. To read a question through the compressed context
    instead (kvpress's usage), compress the context alone and pass `torch.cat([cache.prompt_ids, question], 1)`.
    A generate call appends its tokens to the cache; the next generate call rewinds it to the compressed
    prompt first (so each call reads what its own input ids say after the prompt), and `rewind()` does
    the same by hand (for your own forward passes).
    """

    def __init__(self, cache: CompressedCache, prompt_ids: torch.Tensor, first_token: int, counts: np.ndarray,
                 label: str, budget: int, kv_bytes: int | None = None):
        super().__init__(cache.layers, cache.num_variants)
        self.kv_bytes = kv_bytes  # the bytes its entries take as the method stores them (`methods.core.quantized`)
        self.prompt_ids = prompt_ids  # [1, n]
        self.input_ids = torch.cat([prompt_ids, prompt_ids.new_tensor([[first_token]])], dim=1)
        self.counts = counts  # [L, H_kv] entries kept per layer and KV head
        self.method = label
        self.budget = budget

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_ids.shape[1])

    # `generate` marks a cache it is given at the start of every call: the mark rewinds it, so a second
    # call with `cache.input_ids` answers as the first did instead of appending the prompt again.
    @property
    def _is_user_defined(self) -> bool:
        return getattr(self, "_given_to_generate", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._given_to_generate = bool(value)
        if value:
            self.rewind()

    @property
    def kept_entries(self) -> int:
        """Prompt entries kept in all layers and KV heads together: L x H_kv x B (or all when n <= B)."""
        return int(self.counts.sum())

    def prompt_bytes(self) -> int:
        """Bytes the kept prompt entries occupy (keys, values, and the bias of padded heads), measured on the
        tensors' storage, so a view into a larger tensor would count in full."""
        storages = {}
        for layer in self.layers:
            for tensor in (layer.prompt_keys, layer.prompt_values, layer.prompt_bias):
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def rewind(self) -> CompressedPrompt:
        """Drop the tokens earlier generate calls appended; the compressed prompt entries stay."""
        for layer in self.layers:
            layer.crop(self.prompt_length)
        return self


def _vocabulary(model) -> int | None:
    """Rows of the model's input embedding: the token ids it can read."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(embeddings.num_embeddings) if embeddings is not None else None


def _check_model(model) -> None:
    from ripplekv.engine import adapter
    from ripplekv.engine.models import _check_supported

    config = getattr(model, "config", None)
    if config is None or not callable(model):
        raise UserError(f"pass a loaded transformers model (e.g. from ripplekv.load_model()), got {type(model).__name__}")
    _check_supported(config)
    adapter.check_supported(config)


def _methods(model, specs: Sequence[str], allocation: str | None, options: dict) -> dict:
    """label -> Method (`full` first), as eval builds them, with eval's default allocation when none is given (the
    last `ripplekv allocate` output, else the one shipped for the bundled model: a `Notice` says which)."""
    import warnings

    from ripplekv.engine.models import is_bundled
    from ripplekv.errors import Notice
    from ripplekv.methods.core.catalog import build_methods, check_fitted
    from ripplekv.pipeline.eval_plan import default_allocation

    if allocation is None:
        allocation, note = default_allocation(specs, bundled=is_bundled(model))
        if note:
            warnings.warn(Notice(note), stacklevel=3)
    built = build_methods(specs, {**options, "allocation": allocation})
    check_fitted(built.values(), model.config, is_bundled(model))  # a missing or foreign fitted file: before any prefill
    return built


def positive_integer(value, name: str) -> int:
    """An integer argument as the CLI takes it (numpy integers too; not a bool, a string or a float)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise UserError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_tokenizer(tokenizer) -> None:
    if tokenizer is None or not callable(tokenizer):
        raise UserError(f"pass the model's tokenizer (from ripplekv.load_model()), got {type(tokenizer).__name__}")


def _token_ids(tokenizer, prompt, chat: bool, vocab: int | None = None) -> list[int]:
    """The prompt's token ids: text (tokenized), a `Prompt`, or ids, each checked to be in the vocabulary."""
    ids = _prompt_ids(tokenizer, prompt, chat)
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise UserError(f"prompt token id {bad[0]} is outside the model's vocabulary (0 to {vocab - 1 if vocab else '...'}); "
                        "pass ids from the model's own tokenizer")
    return ids


def _prompt_ids(tokenizer, prompt, chat: bool) -> list[int]:
    if prompt is None or isinstance(prompt, (bytes, dict, set)):
        raise UserError(f"prompt must be text, token ids or a Prompt from ripplekv.sample_prompt, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UserError("the prompt is empty; pass text or token ids")
        _check_tokenizer(tokenizer)
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        return list(tokenizer(prompt).input_ids)
    if isinstance(prompt, Prompt):
        return list(prompt.ids)
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise UserError(f"prompt must be text, token ids or a Prompt from ripplekv.sample_prompt, "
                        f"got {type(prompt).__name__} that is not a sequence of integers") from None
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.numel() == 0:
        raise UserError(f"prompt ids must be one non-empty sequence of token ids (shape [n] or [1, n]), got shape "
                        f"{list(ids.shape)}")
    return ids.tolist()


def compress(model, tokenizer, prompt, method: str = "ripplekv", budget: int = 128, *, chat: bool = False,
             allocation: str | None = None, **options) -> CompressedPrompt:
    """Prefill `prompt` once with full attention and keep `budget` entries per layer per KV head on average,
    chosen by `method` (a spec, e.g. "snapkv" or "pyramidkv:beta=10"; `options` such as window=16 apply
    to it as the CLI's flags do).

    `prompt`: text (`chat=True` wraps it in the chat template as one user turn, as eval does), token ids,
    or a `Prompt` from `sample_prompt` (an eval sample, token for token). RippleKV's budgets come from
    `allocation` (a CSV from `ripplekv allocate`; the bundled model has one shipped). Every layer's heads
    hold only what they keep: `cache.prompt_bytes()` is the memory really used.
    """
    from ripplekv.engine.cache import build_cache
    from ripplekv.engine.prefill import prefill_for
    from ripplekv.engine.recorders import SampleContext
    from ripplekv.engine.schedule import Variant, build, entry_counts
    from ripplekv.methods.core.budgets import check_budget

    _check_model(model)
    if not isinstance(method, str):
        raise UserError(f"method must be a spec string such as 'snapkv', got {type(method).__name__}")
    chosen = list(_methods(model, [method], allocation, options).values())[-1]
    budget = check_budget(int(budget) if isinstance(budget, Integral) and not isinstance(budget, bool) else budget)
    ids = _token_ids(tokenizer, prompt, chat, _vocabulary(model))
    inside = prompt.question_start if isinstance(prompt, Prompt) and 0 < prompt.question_start < len(ids) else None
    state = prefill_for(model, ids, chosen.requirements(), context=SampleContext(tokenizer, question_at=inside))
    built = build(state, Variant(chosen.label, budget, chosen))
    counts = entry_counts(built)
    cache = build_cache(state, [built])
    from ripplekv.methods.core.quantized import kept_bytes, stored_as

    return CompressedPrompt(cache, state.input_ids[None], int(state.last_logits.argmax()), counts, chosen.label, budget,
                            kept_bytes(state, counts, stored_as(chosen, state, budget)))


@dataclass(frozen=True)
class Answer:
    """One variant's greedy answer, with what it kept and how closely it followed the full cache."""

    method: str
    budget: int | None  # None for `full`
    text: str | None  # None for an infeasible variant
    new_tokens: int
    kept_entries: int
    layer_budgets: list  # entries per KV head in each layer
    kl: float | None  # mean KL(full || variant) along the full cache's answer (0 for full; None if infeasible)
    agreement: float | None  # share of the full answer's tokens the variant also ranks first
    score: float | None  # against `answers` with the metric of `score_as`; None without answers
    # True for a bound that reads the full cache's answer (oracle, allocation-ceiling): not a method to deploy
    # or to rank against methods (reports leave ceilings out of ranks); False for methods and `full`
    ceiling: bool = False
    # why a quantized variant could not run: its fewest bytes exceed budget B's on this prompt (eval's line says
    # the same); it then has no text and no numbers. None for every variant that ran.
    infeasible: str | None = None


def _text_task(question: str | None, max_new_tokens: int, score_as: str, chat: bool):
    """A one-off task for the caller's text: its template puts the question after the context."""
    from ripplekv.metrics.scoring import metric_for
    from ripplekv.tasks import Task

    template = "{context}\n\n{input}" if question else "{context}"
    return Task(name=score_as, suite="python", category="", metric=metric_for(score_as), max_new_tokens=max_new_tokens,
                prompt_template=template, chat_template=chat, stop_at_newline=False)


def generate(model, tokenizer, context: str, question: str | None = None,
             methods: str | Sequence[str] = ("snapkv", "ripplekv"), budgets: int | Sequence[int] = (128,), *,
             max_new_tokens: int = 64, protocol: str = "with-question", answers: Sequence[str] | None = None,
             score_as: str = "squad", chat: bool = True, allocation: str | None = None, batch_size: int = EVAL_BATCH_SIZE,
             memory_budget: str | int | None = None, **options) -> list[Answer]:
    """Answers of `full` and every (method, budget) from ONE prefill, decoded together, as eval does.

    The prompt is the context, then the question (in the chat template unless `chat=False`).
    `protocol="context-only"` compresses the context alone and reads the question through each compressed
    cache (a cache reused across questions); the default compresses the whole prompt. Each answer says
    how many entries it kept and its KL/agreement to the full cache's answer; with `answers`, its score.
    `memory_budget` ('40GiB', '500MB' or bytes) bounds what the sample holds, as eval's --memory-budget.
    """
    from ripplekv.defaults import SINGLE_QUESTION_PROTOCOLS as PROTOCOLS
    from ripplekv.methods.core.budgets import check_budget
    from ripplekv.pipeline.eval_plan import parse_budgets, parse_names
    from ripplekv.pipeline.evaluate import SampleSettings, evaluate_sample

    _check_model(model)
    if not isinstance(context, str) or not context.strip():
        raise UserError("the context is empty; pass the text to compress")
    if question is not None and not isinstance(question, str):
        raise UserError(f"question must be text or None, got {type(question).__name__}")
    if protocol not in PROTOCOLS:
        raise UserError(f"{{protocol}} must be one of {', '.join(PROTOCOLS)}, got {protocol!r}", "protocol")
    max_new_tokens = positive_integer(max_new_tokens, "max_new_tokens")
    batch_size = positive_integer(batch_size, "batch_size")
    if answers is not None and (isinstance(answers, str) or not all(isinstance(a, str) for a in answers)):
        raise UserError("answers must be a list of strings (the gold answers), e.g. ['Paris']")
    from ripplekv.engine.memory import parse_bytes

    limit = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
    specs = parse_names(methods, "methods")
    if isinstance(budgets, (Integral, str)):
        budgets = [budgets]
    try:
        budgets = list(budgets)
    except TypeError:
        raise UserError(f"budgets must be a positive integer or a list of them, got {budgets!r}") from None
    chosen_budgets = parse_budgets([check_budget(int(b)) if isinstance(b, Integral) and not isinstance(b, bool) else b
                                    for b in budgets])
    built = _methods(model, specs, allocation, options)
    _check_tokenizer(tokenizer)
    task = _text_task(question, max_new_tokens, score_as, chat)
    record = {"_id": "text", "context": context, "input": question or "", "answers": list(answers or [])}
    settings = SampleSettings(max_length=NO_TRUNCATION, batch_size=batch_size, protocol=protocol, memory_budget=limit)
    rows = evaluate_sample(model, tokenizer, task, record, built, chosen_budgets, settings, sid="text")
    return [_answer(row, bool(built[row["method"]].knows_answer), bool(answers)) for row in rows]


def _answer(row: dict, ceiling: bool, scored: bool) -> Answer:
    """An eval line as an `Answer`; an infeasible variant's line (its bytes cannot fit its budget on this prompt)
    has no answer and no numbers: `infeasible` says why."""
    if row.get("infeasible"):
        return Answer(row["method"], row["budget"], None, 0, 0, [], None, None, None, ceiling=ceiling,
                      infeasible=row["infeasible"])
    return Answer(row["method"], row["budget"], row["prediction"], row["new_tokens"], row["kept_entries"],
                  row["layer_budgets"], row["kl"], row["agreement"], row["score"] if scored else None, ceiling=ceiling)
