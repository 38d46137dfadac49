"""Layer-wise method routing: which eviction method suits each layer, measured offline.

Preferences: for every calibration sample the context is prefilled once; then for every layer l and
candidate method m, layer l alone is compressed to budget B with m's scorer (every other layer full) and
KL(full || variant) is measured at the probe tokens, as `ripplekv profile` does. A trial differs from the
clean run only in layer l, so it is a key bias (-inf on the entries m evicts) that joins the batch at
layer l: all L x M trials of a sample run batched from one prefill (`engine.probe.ProbeRunner`).

Route: per layer the method with the lowest mean KL; with `--max-share` caps (method m in at most
floor(share x L) layers) the assignment that minimizes the total KL under the caps (an exact assignment
over method slots).

Placement study: random assignments with the same method counts as the route (permutations of it),
scored by teacher-forced KL along the full cache's greedy answer at budget B, every placement batched
from one prefill per prompt. The route's rank among them asks whether the profile put each method in the
right layers, not only picked a good mix. Placements are scored on calibration samples held out from
the preferences, so the rank is not measured on the data the route was chosen on. Each placement is
compared with the route by a paired bootstrap over those samples (`analysis.placement`): placements.csv
gives every placement's difference to the route with its interval and verdict, route.json the route's
rank with its intervals and the shares of placements significantly better and worse.

Stability: routes are also chosen on the even and the odd preference prompts apart; route.json records on how
many layers the two halves agree, beside the agreement expected by chance (`analysis.agreement`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ripplekv.analysis.agreement import route_agreement
from ripplekv.analysis.placement import placement_verdict
from ripplekv.defaults import DEFAULT_ROUTE_CANDIDATES, PROBE_TOKENS
from ripplekv.engine import entries
from ripplekv.engine.decode import stop_tokens
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods.core.base import held_mask
from ripplekv.methods.core.budgets import check_budget, uniform_budgets
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.pipeline.route_choice import choose_route, parse_caps, random_placements  # noqa: F401 - as before
from ripplekv.pipeline.route_plots import plot_placements, plot_preferences, plot_route
from ripplekv.runs.files import ROUTE_FILES
from ripplekv.runs.safeio import check_output, other_files, write_csv, write_text
from ripplekv.tasks.calibration import Calibration

DEFAULT_CANDIDATES = DEFAULT_ROUTE_CANDIDATES


@dataclass(frozen=True)
class RouteSettings:
    """Everything that determines a route and its placement study (written to route.json)."""

    methods: tuple[str, ...] = DEFAULT_CANDIDATES
    budget: int = 128
    probe_tokens: int = PROBE_TOKENS
    batch_size: int = 32
    max_share: tuple[str, ...] = ()
    placements: int = 100
    max_new_tokens: int = 32
    seed: int = 0

    def check(self) -> None:
        check_budget(self.budget)
        if self.probe_tokens < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise UserError("--probe-tokens, --batch-size and --max-new-tokens must be positive integers")
        if self.placements < 0:
            raise UserError(f"--placements must be 0 or more, got {self.placements}")


def candidate_methods(specs) -> list:
    """The candidate methods, resolved through the registry; only their scorers are used (`router.routed_scorer`
    refuses a method that is more than its scorer), and two candidates with one scorer are refused."""
    from ripplekv.methods import PRESETS, make_method, parse_spec
    from ripplekv.methods.core.spec import check_distinct
    from ripplekv.methods.router import routed_scorer, scorer_identity

    if len(specs) < 1:
        raise UserError("--methods is empty; name at least one candidate, e.g. --methods snapkv,streamingllm")
    built, scorers = [], []
    for spec in specs:
        if parse_spec(spec)[0] not in PRESETS:
            raise UserError(f"candidate method {spec!r} is not registered in this version; "
                            "pass --methods with methods from `ripplekv methods`")
        method = make_method(spec)
        if method.knows_answer:
            raise UserError(f"candidate {spec!r} is answer-aware (it needs the full cache's answer), not a method to route to")
        try:
            scorers.append(scorer_identity(routed_scorer(spec, method)))
        except UserError as err:
            raise UserError(f"candidate {err}") from None
        built.append(method)
    check_distinct(built)
    seen: dict[str, str] = {}
    for spec, identity in zip(specs, scorers):  # another name for a scorer already given (`uniform` for `snapkv`)
        if identity in seen:
            raise UserError(f"--methods names one scorer twice ({seen[identity]} and {spec} select the same entries in "
                            "a layer); name each candidate once")
        seen[identity] = spec
    return built


def check_placement_study(candidates: int, placements: int, placement_samples: int) -> None:
    """A placement study needs two candidates (with one, every placement is the route) and prompts to score them."""
    if placements and candidates < 2:
        raise UserError(f"a placement study over one candidate ranks {placements} placements identical to the route; "
                        "name two or more --methods, or pass --placements 0")
    if placements and placement_samples < 1:
        raise UserError(f"--placement-samples {placement_samples} leaves no prompts to score the {placements} "
                        "placements on; give 1 or more (2 for an interval), or pass --placements 0 to skip the study")


def route_prefill(model, ids, candidates, probe_tokens: int, reserve: int):
    """The one prefill every routing step uses, recording what every candidate needs."""
    needs = Requirements.of_all(candidates).union(Requirements(capture_window=probe_tokens))
    return prefill_for(model, ids, needs, reserve=reserve)


def layer_keep(state, method, layer: int, budget: int) -> torch.Tensor:
    """Bool mask [H_kv, n]: the entries `method`'s scorer keeps in `layer` at the uniform budget B (fitted to
    what each layer can hold, as every method's budgets are)."""
    count = uniform_budgets(state.num_layers, budget, state.capacities)[layer]
    if count >= state.capacity(layer):
        return held_mask(state, layer)
    counts = torch.full((state.num_kv_heads,), count, dtype=torch.long, device=state.device)
    return method.scorer.keep(state, layer, counts)


@torch.inference_mode()
def preference_prompt(model, prompt, candidates, settings: RouteSettings) -> np.ndarray:
    """KL [L, M] for one calibration sample: layer l alone compressed with method m, all from one prefill."""
    from ripplekv.engine.cache import VariantOverride
    from ripplekv.engine.probe import ProbeRunner

    state = route_prefill(model, prompt.context, candidates, settings.probe_tokens, len(prompt.probe))
    runner = ProbeRunner(model, state, prompt.probe)
    layers, changes = [], []
    for layer in range(state.num_layers):
        for index, method in enumerate(candidates):
            keep = layer_keep(state, method, layer, settings.budget)
            bias = torch.zeros(keep.shape, device=state.device).masked_fill(~keep, float("-inf"))
            layers.append(layer)
            changes.append(VariantOverride(index, key_bias=bias))
    kl = runner.perturbed_kl(changes, settings.batch_size, layers)
    return kl.reshape(state.num_layers, len(candidates))


@torch.inference_mode()
def placement_prompt(model, prompt, candidates, assignments: list[list[str]], settings: RouteSettings, stop_ids):
    """Fidelity of each assignment (a method label per layer) on one prompt, from one prefill."""
    from ripplekv.engine.decode import full_reference, measure_fidelity

    state = route_prefill(model, prompt.context + prompt.probe, candidates, settings.probe_tokens, settings.max_new_tokens)
    reference = full_reference(model, state, settings.max_new_tokens, stop_ids)
    by_label = {method.label: method for method in candidates}
    built: dict[tuple[int, str], entries.LayerEntries] = {}

    def layer_entries(layer: int, label: str) -> entries.LayerEntries:
        if (layer, label) not in built:
            keep = layer_keep(state, by_label[label], layer, settings.budget)
            full = bool((keep == held_mask(state, layer)).all())
            built[(layer, label)] = state.full_entries(layer) if full else entries.gather(state.keys[layer], state.values[layer], keep)
        return built[(layer, label)]

    variants = [[layer_entries(layer, label) for layer, label in enumerate(assignment)] for assignment in assignments]
    return measure_fidelity(model, state, variants, reference, settings.batch_size)


@dataclass
class RouteResult:
    """Preferences, the chosen route and the placement study."""

    labels: list[str]
    sample_ids: list[str]
    preferences: np.ndarray  # [samples, L, M]
    route: list[str]
    caps: dict[str, int]
    placement_ids: list[str]
    assignments: list[list[str]]  # the route first, then the random placements
    placement_kl: np.ndarray  # [placement samples, assignments]
    placement_agreement: np.ndarray

    def rank(self) -> int | None:
        """1 + the number of random placements with lower mean KL than the route (1 = best)."""
        if self.placement_kl.size == 0 or len(self.assignments) < 2:
            return None
        mean = self.placement_kl.mean(0)
        return 1 + int((mean[1:] < mean[0]).sum())

    def verdict(self):
        """The paired-bootstrap comparison of every placement with the route (None under 2 samples: one
        sample has no spread to resample)."""
        if self.rank() is None or self.placement_kl.shape[0] < 2:
            return None
        return placement_verdict(self.placement_kl, self.placement_ids)

    def split_half(self) -> dict | None:
        """Routes chosen on the even and on the odd preference prompts apart (same caps), and how many layers
        they agree on beside chance; None under 2 prompts."""
        samples = self.preferences.shape[0]
        if samples < 2:
            return None
        halves = [choose_route(self.preferences[part::2].mean(0), self.labels, self.caps) for part in (0, 1)]
        return {**route_agreement(*halves), "samples": [len(range(0, samples, 2)), len(range(1, samples, 2))],
                "routes": halves}


def run_route(model, preference_prompts, placement_prompts, settings: RouteSettings, progress=None) -> RouteResult:
    """Preferences on `preference_prompts`, the route, then the placement study on `placement_prompts`."""
    settings.check()
    candidates = candidate_methods(settings.methods)
    labels = [m.label for m in candidates]
    per_sample = []
    for prompt in preference_prompts:
        per_sample.append(preference_prompt(model, prompt, candidates, settings))
        if progress is not None:
            progress(prompt)
    preferences = np.stack(per_sample)
    caps = parse_caps(settings.max_share, labels, preferences.shape[1])
    route = choose_route(preferences.mean(0), labels, caps)
    # A route with one method in every layer has no placement but itself: nothing to rank it among.
    studied = settings.placements and len(set(route)) > 1
    assignments = [route, *random_placements(route, settings.placements, settings.seed)] if studied else []
    kl, agreement = [], []
    stop = stop_tokens(model)
    for prompt in placement_prompts if assignments else []:
        scores = placement_prompt(model, prompt, candidates, assignments, settings, stop)
        kl.append([s.kl for s in scores])
        agreement.append([s.agreement for s in scores])
        if progress is not None:
            progress(prompt)
    return RouteResult(
        labels, [p.sample_id for p in preference_prompts], preferences, route, caps,
        [p.sample_id for p in placement_prompts] if assignments else [], assignments,
        np.asarray(kl, dtype=float).reshape(len(kl), len(assignments)),
        np.asarray(agreement, dtype=float).reshape(len(agreement), len(assignments)),
    )


def check_route_dir(out: Path, model: str | None = None) -> Path:
    """Before any model work: `out` must be a writable directory, new, empty or an earlier route."""
    from ripplekv.engine.models import resolve_model

    source = resolve_model(model)
    check_output(out, kind="dir", inputs=[source.location] if source.kind == "gguf" else [], writes=ROUTE_FILES,
                 run="route")
    foreign = other_files(out, ROUTE_FILES)
    if foreign and not (out / "route.json").is_file():
        raise UserError(f"--out {out} holds other files ({', '.join(foreign[:3])}), not a route; "
                        "pass a new or empty directory")
    return out


def check_route_window(model_spec, settings: RouteSettings, calibration: Calibration, placement_samples: int) -> None:
    """A sliding-window model: the calibration prompts (and the answers placements decode) must fit it,
    said before the model loads or the route folder is made, with a --target-tokens that fits."""
    from ripplekv.engine.models import load_tokenizer
    from ripplekv.pipeline.samples import check_calibration_window, model_window

    if model_window(model_spec) is None:
        return
    tokenizer = load_tokenizer(model_spec)

    def build(target: int):
        return calibration.prompts(tokenizer, settings.probe_tokens, target_tokens=target,
                                   count=calibration.samples + placement_samples)

    check_calibration_window(model_spec, build(calibration.target_tokens), build, calibration.target_tokens,
                             reserve=settings.max_new_tokens if placement_samples else 0)


def route_into(out: Path, model: ModelChoice, settings: RouteSettings, calibration: Calibration,
               placement_samples: int, progress_bar=None) -> tuple[dict, int, int]:
    """The whole `ripplekv route` after its checks: load the model, take calibration prompts (the first
    `calibration.samples` of its draw's share for preferences, `placement_samples` more held out for the
    placement study), route and write. Returns (route.json's content, layers routed, placement prompts).
    `progress_bar(total)` gives (a context manager, an advance callback), as the CLI's bar does."""
    from contextlib import nullcontext

    from ripplekv.engine.models import runtime_info
    from ripplekv.tasks.calibration import calibration_hash

    calibration.check()
    calib_samples = calibration.samples
    loaded, tokenizer, source = model.load()
    prompts = calibration.prompts(tokenizer, settings.probe_tokens, count=calib_samples + placement_samples)
    chosen, scored = prompts[:calib_samples], prompts[calib_samples:]
    if placement_samples and not scored:
        raise UserError(f"the calibration split has only {len(prompts)} prompts; lower --calib-samples to leave some for placements")
    bar, advance = progress_bar(len(chosen) + len(scored)) if progress_bar else (nullcontext(), None)
    with bar:
        result = run_route(loaded, chosen, scored, settings, progress=advance)
    meta = {"model": source.label, "calibration_hash": calibration_hash(chosen), "with_answer": calibration.with_answer,
            "target_tokens": calibration.target_tokens, **calibration.record(), "device": model.device, "dtype": model.dtype,
            **runtime_info(model.device)}
    return write_route(result, settings, Path(out), meta), len(result.route), len(scored)


def write_route(result: RouteResult, settings: RouteSettings, out: Path, meta: dict) -> dict:
    """ROUTE.csv, preferences.csv (+ per sample), placements.csv, route.json and the plots in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    mean = result.preferences.mean(0)
    layers = np.arange(mean.shape[0])
    matrix = pd.DataFrame(mean, columns=result.labels).assign(layer=layers)[["layer", *result.labels]]
    write_csv(out / "preferences.csv", matrix, float_format="%.8g")
    samples, num_layers, methods = result.preferences.shape
    per_sample = pd.DataFrame({
        "sample_id": np.repeat(result.sample_ids, num_layers * methods),
        "layer": np.tile(np.repeat(layers, methods), samples),
        "method": np.tile(result.labels, samples * num_layers),
        "kl": result.preferences.reshape(-1),
    })
    write_csv(out / "preferences_per_sample.csv", per_sample, float_format="%.8g")
    route = pd.DataFrame({"layer": layers, "method": result.route})
    for index, label in enumerate(result.labels):
        route[f"kl_{label}"] = mean[:, index]
    write_csv(out / "ROUTE.csv", route, float_format="%.8g")
    rank, verdict = result.rank(), result.verdict()
    if result.assignments:
        placements = pd.DataFrame({
            "placement": np.arange(len(result.assignments)),
            "is_route": [True] + [False] * (len(result.assignments) - 1),
            "kl": result.placement_kl.mean(0),
            "agreement": result.placement_agreement.mean(0),
        })
        if verdict is not None:
            placements = placements.assign(kl_minus_route=verdict.difference, diff_low=verdict.low,
                                           diff_high=verdict.high, p_value=verdict.p, p_holm=verdict.p_holm,
                                           verdict=verdict.verdict)
        placements["methods"] = [";".join(a) for a in result.assignments]
        write_csv(out / "placements.csv", placements, float_format="%.8g")
        count = len(result.assignments)
        write_csv(out / "placements_per_sample.csv", pd.DataFrame({
            "sample_id": np.repeat(result.placement_ids, count),
            "placement": np.tile(np.arange(count), len(result.placement_ids)),
            "kl": result.placement_kl.reshape(-1),
            "agreement": result.placement_agreement.reshape(-1),
        }), float_format="%.8g")
        plot_placements(placements, rank, out / "placements.png")
    counts = {label: result.route.count(label) for label in result.labels}
    meta = {
        **meta,
        **asdict(settings),
        "candidates": result.labels,
        "caps": result.caps,
        "route": result.route,
        "method_counts": counts,
        "calibration_ids": result.sample_ids,
        "placement_ids": result.placement_ids,
        "placement_rank": rank,
        "placements_scored": max(len(result.assignments) - 1, 0),
        "placement_study": verdict.summary() if verdict is not None else None,
        "placement_summary": verdict.line() if verdict is not None else None,
        "split_half": result.split_half(),
    }
    write_text(out / "route.json", json.dumps(meta, indent=2) + "\n")
    plot_preferences(mean, result.labels, result.route, out / "preferences.png")
    plot_route(mean, result.labels, result.route, out / "ROUTE.png")
    return meta
