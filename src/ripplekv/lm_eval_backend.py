"""ripplekv as an lm-evaluation-harness model backend: lm-eval's own tasks under a compressed KV cache.

Each context lm-eval sends is prefilled once with full attention and compressed by the method to exactly the
L x H_kv x B entries `ripplekv eval` keeps. `loglikelihood` scores every continuation lm-eval asks of that
context through that one compressed cache (the continuations as rows of one batch, so the prefill and the
compression are shared); `generate_until` decodes greedily under it with eval's own decoder, so its answer is
eval's for the same prompt. Tokenization is lm-eval's (`TemplateLM`), as its `hf` backend does it, so `full`
gives the `hf` backend's numbers.

lm-eval 0.4.13 finds a backend only in its own registry (it reads no entry points and has no `--plugins`):
importing this module registers `ripplekv`, and `ripplekv lm-eval` imports it, then runs lm-eval's command line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import forward_tokens, greedy_decode, stop_tokens
from ripplekv.engine.entries import LayerEntries
from ripplekv.engine.prefill import PrefillState, prefill_for
from ripplekv.engine.recorders import SampleContext
from ripplekv.errors import UserError
from ripplekv.methods.core.base import Method
from ripplekv.methods.core.budgets import check_budget

BACKEND_NAME = "ripplekv"
# What lm-eval itself hands every backend (None when its command line leaves them out).
LM_EVAL_SETTINGS = ("batch_size", "max_batch_size", "device")
DEFAULT_BUDGET = 128


def chosen_method(method: str, budget, allocation: str | None = None, bundled: bool = False,
                  **options) -> tuple[Method, int]:
    """The checked method and budget of the model arguments: a bad spec, option or budget is a UserError, and so
    is a method that needs the full cache's answer (lm-eval's requests have none). `bundled`: the model is the
    bundled SmolLM2, whose shipped allocation profile-driven methods use unless `allocation` names another."""
    from ripplekv.methods.core.catalog import build_methods
    from ripplekv.methods.core.spec import shared_option_users

    if not isinstance(method, str) or not method.strip():
        raise UserError(f"model_args method= must be a method spec such as snapkv or pyramidkv:beta=10, got {method!r}")
    budget = check_budget(budget)
    shared = {**options, "allocation": allocation}
    if allocation is None and shared_option_users([method], {"allocation": "?"})["allocation"]:
        import warnings

        from ripplekv.errors import Notice
        from ripplekv.pipeline.eval_plan import default_allocation

        shared["allocation"], note = default_allocation([method], bundled=bundled)
        if note:
            warnings.warn(Notice(note), stacklevel=2)
    picked = list(build_methods([method], shared).values())[-1]
    if picked.knows_answer:
        raise UserError(f"{picked.label} reads the full cache's answer (a ceiling, not a method); lm-eval requests "
                        "have no such answer: choose a method such as snapkv")
    return picked, budget


MODEL_SETTINGS = ("model", "dtype", "max_gen_toks", *LM_EVAL_SETTINGS)  # model arguments that are not the method's


def check_model_args(args: dict | str) -> dict:
    """`--model_args` (as lm-eval parsed them, or its `a=1,b=2` string) with the method and budget checked before
    lm-eval starts (what `ripplekv lm-eval` does)."""
    args = simple_parse_args_string(args) if isinstance(args, str) else dict(args)
    options = {k: v for k, v in args.items() if k not in MODEL_SETTINGS}
    chosen_method(options.pop("method", "full"), options.pop("budget", DEFAULT_BUDGET),
                  bundled=args.get("model") in (None, ""), **options)
    return args


@dataclass
class Compressed:
    """One context's prefill and the method's entries for it (None: the full cache)."""

    state: PrefillState
    entries: list[LayerEntries] | None
    kept: np.ndarray  # [L, H_kv] prompt entries kept per layer and KV head


@register_model(BACKEND_NAME)
class RippleKVLM(TemplateLM):
    """lm-eval's `LM` over ripplekv's engine. Model arguments: `model` (hub id, folder or .gguf; default the
    bundled SmolLM2), `method` (any spec; default `full`), `budget` (B, default 128), `allocation` (a CSV for
    profile-driven methods), `dtype`, `max_gen_toks`; other keys are the method's options (`window=16`)."""

    def __init__(self, model: str | None = None, method: str = "full", budget: int = DEFAULT_BUDGET, allocation: str | None = None,
                 device: str | None = None, dtype: str = "auto", batch_size=1, max_batch_size=None,
                 max_gen_toks: int = 256, **options):
        super().__init__()
        from ripplekv.api import positive_integer
        from ripplekv.engine.models import is_bundled, load_model

        self.max_gen_toks = positive_integer(max_gen_toks, "model_args max_gen_toks")
        self.model, self.tokenizer, _ = load_model(None if model in (None, "") else str(model),
                                                   device=device or "auto", dtype=dtype)
        self.method, self.budget = chosen_method(method, budget, allocation, is_bundled(self.model), **options)
        from ripplekv.methods.core.catalog import check_fitted

        check_fitted([self.method], self.model.config, is_bundled(self.model))
        self.kept_per_context: list[np.ndarray] = []  # what each scored or generated context kept, in order

    # ---------------------------------------------------------------- lm-eval's tokenization contract
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The one-token context of an empty context: BOS where the tokenizer has one, as lm-eval's hf backend."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **extra))

    # ---------------------------------------------------------------- the engine
    def _compress(self, ids: list[int], reserve: int) -> Compressed:
        """Prefill `ids` once and keep the method's entries at the budget (all of them under `full`)."""
        state = prefill_for(self.model, ids, self.method.requirements(), reserve=reserve,
                            context=SampleContext(self.tokenizer))
        if self.method.is_full:
            kept = np.full((state.num_layers, state.num_kv_heads), state.length, dtype=np.int64)
            return Compressed(state, None, kept)
        built = self.method.compress(state, self.budget)
        kept = np.array([[int(c) for c in layer.counts.tolist()] for layer in built], dtype=np.int64)
        return Compressed(state, built, kept)

    @torch.inference_mode()
    def _score(self, context: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each continuation after `context`, all read through one compressed
        cache: the first token from the prefill's own prediction, the rest fed as rows of one batch."""
        longest = max(len(c) for c in continuations)
        done = self._compress(context, reserve=longest)
        self.kept_per_context.append(done.kept)
        state = done.state
        first = torch.log_softmax(state.last_logits.float(), -1)
        rest = None
        if longest > 1:
            rows = len(continuations)
            cache = build_cache(state, None if done.entries is None else [done.entries] * rows, rows)
            fed = torch.full((rows, longest - 1), self.eot_token_id, dtype=torch.long, device=state.device)
            for row, tokens in enumerate(continuations):
                fed[row, :len(tokens) - 1] = torch.as_tensor(tokens[:-1], dtype=torch.long)
            # padding sits after each row's own tokens: causal attention never lets them reach a scored position
            rest = torch.log_softmax(forward_tokens(self.model, cache, fed, state.length), -1)
        results = []
        for row, tokens in enumerate(continuations):
            logprobs = first[None] if len(tokens) == 1 else torch.cat([first[None], rest[row, :len(tokens) - 1]])
            target = torch.as_tensor(tokens, dtype=torch.long, device=logprobs.device)
            total = float(logprobs.gather(-1, target[:, None]).sum())
            results.append((total, bool((logprobs.argmax(-1) == target).all())))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        by_context: dict[tuple[int, ...], list[int]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise UserError("an lm-eval request has an empty continuation; nothing to score")
            by_context.setdefault(tuple(context), []).append(index)
        results: list = [None] * len(requests)
        for context, indices in by_context.items():
            for index, scored in zip(indices, self._score(list(context), [list(requests[i][2]) for i in indices])):
                results[index] = scored
                self.cache_hook.add_partial("loglikelihood", requests[index][0], scored)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise UserError("loglikelihood_rolling (perplexity tasks such as wikitext) is not supported by the ripplekv "
                        "backend: its windows score every token against its own uncompressed window, so no budget "
                        "would apply; use lm-eval's hf backend for perplexity, ripplekv for loglikelihood and "
                        "generate_until tasks")

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy answers under the compressed cache, as `ripplekv eval` decodes (the first token from the
        prefill, then the compressed cache), cut at lm-eval's stop strings; only greedy decoding is offered."""
        answers = []
        for request in requests:
            context, settings = request.args
            settings = dict(settings or {})
            if settings.get("do_sample") or float(settings.get("temperature", 0.0) or 0.0) > 0:
                raise UserError("the ripplekv backend decodes greedily, as eval does; the task asks for sampling "
                                "(do_sample or temperature > 0): set the task's generation_kwargs to greedy")
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(settings.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)
            if not ids:
                raise UserError("an lm-eval generation request has an empty context: there is no prompt to compress")
            done = self._compress(ids, reserve=limit)
            self.kept_per_context.append(done.kept)
            tokens = greedy_decode(self.model, done.state, None if done.entries is None else [done.entries], limit,
                                   self._stops(until), num_variants=1)[0]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, settings), text)
            answers.append(text)
        return answers

    def _stops(self, until: list[str]) -> list[int]:
        """End-of-text ids, and each stop string that is one token by itself (the text is cut there anyway)."""
        ids = set(stop_tokens(self.model, self.tokenizer))
        for stop in until:
            encoded = self.tok_encode(stop, add_special_tokens=False) if stop else []
            if len(encoded) == 1 and self.tokenizer.decode(encoded) == stop:
                ids.add(int(encoded[0]))
        return sorted(ids)
