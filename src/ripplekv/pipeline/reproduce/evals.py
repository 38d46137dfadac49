"""The evals a reproduce config runs, declared once: the run executes them and the pre-flight checks them.

Each `EvalSpec` is one `ripplekv eval` (or `needle`) with what it is handed: its methods as the pipeline
rewrites them (a stage-fed method gets the stage's file), tasks, budgets, protocol, decode budget and the shared
inputs (`--allocation`, `--route`). `argv` is its command line; the pre-flight (`checks`) builds the same specs
with stand-in files, so what is checked is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ripplekv.analysis.multi_question_page import FOLDER as MULTI_QUESTION
from ripplekv.analysis.multi_question_page import RUNS as MULTI_QUESTION_RUNS
from ripplekv.defaults import PIPELINE_FED
from ripplekv.pipeline.reproduce.config import ReproduceConfig, joined, text

NEEDLE_METHODS = "full,streamingllm,snapkv,pyramidkv,ripplekv"  # `needle_methods` unset
NEEDLE_LIMIT, NEEDLE_BUDGET = 11, 128  # `needle_limit`, `needle_budget` unset


@dataclass(frozen=True)
class EvalSpec:
    """One eval of the pipeline. `setting`: the config setting its methods come from (named in errors)."""

    name: str
    title: str
    setting: str
    methods: str
    budgets: tuple
    limit: int
    target_tokens: int
    out: str
    model: str | None = None
    suite: str = "offline"
    tasks: tuple | None = None
    protocol: str | None = None
    allocation: str | None = None
    route: str | None = None
    decode_budget: str | None = None
    lengths: tuple | None = None  # the needle heatmap's target lengths (a `needle` command)

    def argv(self) -> list[str]:
        model = ["--model", self.model] if self.model else []
        if self.lengths is not None:
            return ["needle", *model, "--lengths", joined(self.lengths), "--limit", text(self.limit),
                    "--budget", text(self.budgets[0]), "--methods", self.methods, "--allocation", self.allocation,
                    "--out", self.out]
        args = ["eval", *model, "--suite", self.suite]
        args += ["--tasks", joined(self.tasks)] if self.tasks else []
        for budget in self.budgets:
            args += ["--budget", text(budget)]
        args += ["--methods", self.methods, "--limit", text(self.limit), "--target-tokens", text(self.target_tokens)]
        args += ["--protocol", self.protocol] if self.protocol else []
        args += ["--allocation", self.allocation] if self.allocation else []
        args += ["--route", self.route] if self.route else []
        args += ["--decode-budget", self.decode_budget] if self.decode_budget else []
        return [*args, "--out", self.out]


def with_stage_files(methods: str, files: dict[str, str]) -> str:
    """`methods` with each stage-fed entry (defaults.PIPELINE_FED) given its stage's file where the stage ran
    (`files`: stage -> file) and the entry names none: `depthkv:scorer=snapkv` ->
    `depthkv:allocation=OUT/depthkv.csv:scorer=snapkv`. Routed methods read eval's --route instead."""
    out = []
    for entry in methods.split(","):
        head, _, rest = entry.partition(":")
        option, stage, _ = PIPELINE_FED.get(head, (None, None, ()))
        if stage in files and option != "route" and f"{option}=" not in rest:
            entry = f"{head}:{option}={files[stage]}" + (f":{rest}" if rest else "")
        out.append(entry)
    return ",".join(out)


def fed_lists(config: ReproduceConfig, files: dict[str, str]) -> tuple[str, str | None]:
    """(methods, headline_methods) with the stages' files: every stage-fed entry of methods; in the headline
    only DepthKV's allocation (the method it is about)."""
    methods = with_stage_files(joined(config.methods), files)
    depth = {stage: path for stage, path in files.items() if stage == "allocate-depthkv"}
    return methods, with_stage_files(joined(config.headline_methods), depth) if config.headline_methods else None


def headline_budget(config: ReproduceConfig) -> int:
    """DepthKV's headline ratio as an entry budget: (1 - prune_ratio) x target_tokens, rounded half up."""
    ratio = config.prune_ratio if config.prune_ratio is not None else 0.6
    return int((1 - ratio) * config.target_tokens + 0.5)


def declared_evals(config: ReproduceConfig, out: str, methods: str, headline: str | None,
                   route: str | None) -> list[EvalSpec]:
    """Every eval after the main one's draws, in the order they run: the main eval first (its `methods` as the
    calibration stages rewrote them), then DepthKV's headline ratio, the head-to-head comparisons, the memory
    axis, the context-only protocol, the long answers under both decode budgets, the multi-question protocols (both
    variants, into OUT/multi-question) and the needle heatmap.
    `route`: eval's --route (the route stage ran) or None. Paths are inside `out`."""
    allocation = f"{out}/allocation.csv"
    shared = dict(model=config.model, suite=config.suite, tasks=config.tasks, target_tokens=config.target_tokens)
    specs = [EvalSpec("eval", "eval", "methods", methods, config.budgets, config.limit, out=f"{out}/eval",
                      allocation=allocation, route=route, **shared)]
    if headline:
        specs.append(EvalSpec("eval-headline", f"eval at DepthKV's headline ratio (B={headline_budget(config)})",
                              "headline_methods", headline, (headline_budget(config),),
                              config.headline_limit or config.limit, out=f"{out}/eval-headline", allocation=allocation,
                              **shared))
    if config.compare_methods:
        specs.append(EvalSpec("eval-compare", "eval, head-to-head comparisons", "compare_methods",
                              joined(config.compare_methods), config.compare_budgets or config.budgets,
                              config.compare_limit or config.limit, out=f"{out}/eval-compare", **shared))
    if config.memory_methods:
        specs.append(EvalSpec("eval-memory", "eval, the memory axis", "memory_methods", joined(config.memory_methods),
                              config.memory_budgets or config.budgets, config.memory_limit or config.limit,
                              out=f"{out}/eval-memory", allocation=allocation, **shared))
    if config.context_methods:
        specs.append(EvalSpec("eval-context-only", "eval, context-only protocol", "context_methods",
                              joined(config.context_methods), config.context_budgets, config.context_limit,
                              config.target_tokens, f"{out}/eval-context-only", model=config.model, suite=config.suite,
                              protocol="context-only", allocation=allocation))
    if config.long_tasks:
        for mode in ("prompt", "total"):
            specs.append(EvalSpec(f"long-{mode}", f"long answers, --decode-budget {mode}", "long_methods",
                                  joined(config.long_methods), config.long_budgets, config.long_limit,
                                  config.long_target_tokens, f"{out}/long/{mode}", model=config.model,
                                  tasks=config.long_tasks, allocation=allocation, decode_budget=mode))
    specs += multi_question_evals(config, out)
    if config.needle_lengths:
        specs.append(EvalSpec("needle", "needle heatmap", "needle_methods",
                              joined(config.needle_methods) if config.needle_methods else NEEDLE_METHODS,
                              (config.needle_budget or NEEDLE_BUDGET,), config.needle_limit or NEEDLE_LIMIT,
                              config.target_tokens, f"{out}/needle", model=config.model, allocation=allocation,
                              lengths=config.needle_lengths))
    return specs


def multi_question_evals(config: ReproduceConfig, out: str) -> list[EvalSpec]:
    """The multi-question protocols' evals (`multi_methods` set): question-agnostic, then the first question in the
    window, each into OUT/multi-question/FOLDER (`analysis.multi_question_page` writes their page)."""
    if not config.multi_methods:
        return []
    return [EvalSpec(f"eval-{protocol}", f"eval, --protocol {protocol}", "multi_methods", joined(config.multi_methods),
                     config.multi_budgets, config.multi_limit, config.target_tokens, f"{out}/{MULTI_QUESTION}/{folder}",
                     model=config.model, suite=config.suite, tasks=config.multi_tasks, protocol=protocol,
                     allocation=f"{out}/allocation.csv")
            for protocol, folder in MULTI_QUESTION_RUNS.items()]


def draws_eval(config: ReproduceConfig, out: str, draw_methods: str) -> EvalSpec:
    """The calibration draws' eval: every calibrated method once more per draw d >= 1, at draw_budgets."""
    return EvalSpec("eval-draws", f"eval, calibrated methods on calibration draws 1-{config.draw_count - 1}",
                    "methods", f"full,{draw_methods}", config.draw_budgets or config.budgets, config.limit,
                    config.target_tokens, f"{out}/eval-draws", model=config.model, suite=config.suite,
                    tasks=config.tasks)
