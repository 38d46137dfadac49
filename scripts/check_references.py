"""Check ripplekv's baselines against the reference code, on the bundled model's own prompts and weights.

Two halves, two environments:
- here (the project's venv): build a few offline-suite prompts, prefill each once, and record what each
  method keeps, in the layout of `ripplekv inspect`'s kept.npz (`analysis.kept.kept_arrays`); PyramidKV's
  schedule comes from `ripplekv budgets` itself.
- `--worker` (a separate venv, `--venv`, made when missing: the same CPU torch, kvpress 0.5.5,
  transformers 5.2.0; `check_references_worker`): load the same dequantized weights and let each kvpress
  press's own code choose: the scorer presses' `compress` in an eager hook (values replaced by their
  positions, so the values it returns are the positions it kept; KVzap's holds our fitted surrogate,
  QFilterPress our fitted filters), the
  masking presses (AdaKV, CriticalAdaKV, LU-KV with our curve set on it) in an sdpa hook, and KVzipPress's
  own reconstruction pass.

For each method with reference code it prints the share of identical (layer, KV head) kept sets and the
mean Jaccard over prompts x budgets x layers x heads, and where the reference's scores are recorded the
share identical up to tied scores (equal scores, where a top-k's choice among ties is unspecified; that share
is what passes). A deliberate difference of ours (exact budgets, a default window) is checked through the
spec that reproduces the reference (PAIRS); docs/methods.md says why each differs. PyramidKV's and CAKE's
per-layer budgets are also compared with their formulas re-implemented here (PyramidKV paper's linear
schedule; cakekv's `pref / sum(pref) * L * (B - w)` with its truncation and `adjust_budgets`), DynamicKV's and
LAVa's with their code's rules (`check_references_allocators`), and AdaKV with FFY0's allocation (exact
totals) on kvpress's SnapKV scores. The KIVI quantizer's quantize-dequantize of the same prompts' K/V is held
against optimum-quanto's affine group quantizer at 2 and 4 bits (`check_references_quant`).
Last line: `reference parity: N/M methods >= 0.99`.

Run: `make check-references` or `bash scripts/check_references.sh [--prompts 4] [--budgets 128,512]`.
`--only finch,kvgrad` compares those pairs alone (the allocator, schedule and quantizer lines left out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from check_references_axes import AXES, compare_axes, save_ours
from check_references_chunks import CHUNK_EARLIER, CHUNK_PAIRS
from check_references_learned import (
    DUO_PAIRS,
    FASTKVZIP_PAIRS,
    KVZAP_PAIRS,
    THRESHOLD_PAIRS,
    duo_note,
    lukv_drift,
    missing_lines,
    shipped_curve,
    shipped_duo_gates,
    shipped_gates,
    shipped_surrogates,
    threshold_note,
)
from check_references_qfilter import QFILTER_PAIRS, missing_line, shipped_filters
from check_references_quant import compare_quantizers, save_kv
from check_references_special import SIMLAYERKV_THRESHOLD
from check_references_worker import KERNEL, WINDOW
from reference_venv import check_venv_path, default_venv, ensure_venv, one_line

PYRAMID_BUDGET = 700  # kvpress's PyramidKVPress is uniform below B = 20 x window: its pyramid is checked here too

# name in the output -> (our spec, reference key in the worker's output); a spec with options beside our
# default is the one that reproduces the reference (docs/methods.md says why our default differs)
PAIRS = {
    "snapkv": (f"snapkv:kernel={KERNEL}:pooling=avg", "snapkv"),
    "streamingllm": ("streamingllm", "streamingllm"),
    "tova": ("tova", "tova"),
    "knorm": ("knorm", "knorm"),
    "h2o:norm=mean": ("h2o:norm=mean:recent=0", "observed"),
    "adakv": (f"adakv:kernel={KERNEL}:pooling=avg", "adakv"),
    "adakv:rule=kvpress": (f"adakv:kernel={KERNEL}:pooling=avg:rule=kvpress", "adakvpress"),
    "criticalkv": (f"criticalkv:kernel={KERNEL}:pooling=avg", "criticalkv"),
    "criticaladakv": (f"criticaladakv:kernel={KERNEL}:pooling=avg:rule=kvpress:safeguard=0.2", "criticaladakv"),
    "expected-attention": ("expected-attention:window=0", "expected"),
    "keydiff": ("keydiff:window=0", "keydiff"),
    "kvzip": ("kvzip:granularity=entry:skip_template=1:window=0", "kvzip"),
    "pyramidkv:schedule=kvpress": (f"pyramidkv:kernel={KERNEL}:pooling=avg:schedule=kvpress", "pyramidkv"),
    "lukv": ("lukv:rounding=kvpress", "lukv"),
    **{name: (spec, key) for name, (spec, key, _) in KVZAP_PAIRS.items()},
    **THRESHOLD_PAIRS,  # DMSPress(KVzapPress): KVzap's threshold mode
    **QFILTER_PAIRS,  # QFilterPress given our fitted filters (check_references_qfilter)
    **FASTKVZIP_PAIRS,  # FastKVzipPress holding our gates
    "finch": ("finch", "finch"),  # its question part: the task's own split (check_references_special)
    "simlayerkv:reading=threshold": (f"simlayerkv:reading=threshold:lazy_threshold={SIMLAYERKV_THRESHOLD}", "simlayerkv"),
    "kvgrad": ("kvgrad:granularity=entry:skip_template=1:window=0", "kvgrad"),
    **CHUNK_PAIRS,
    "leverage": ("leverage:window=0", "leverage"),
    "noncausal": ("noncausal:window=0", "noncausal"),
    "compactor": ("compactor:window=0", "compactor"),
    "cur": ("cur:window=0", "cur"),
    "capkv": ("capkv:window=0", "capkv"),
    "kvcompose:rounding=kvpress": ("kvcompose:window=0:rounding=kvpress", "kvcompose"),
    **DUO_PAIRS,  # DuoAttentionPress given our fitted gates (check_references_learned)
}
LEARNED = {"lukv", *KVZAP_PAIRS, *THRESHOLD_PAIRS, *QFILTER_PAIRS, *DUO_PAIRS, *FASTKVZIP_PAIRS}  # checked only where their curve / surrogate is shipped (check_references_learned)
# Our earlier defaults against the same references: printed for information (they should not match).
EARLIER = {
    "tova:heads=kv": ("tova:heads=kv", "tova"),
    "h2o (H2O sums, split)": ("h2o", "observed"),
    "h2o:recent=0:window=32": ("h2o:recent=0:window=32", "observed"),
    "knorm:window=32": ("knorm:window=32", "knorm"),
    "adakv:rule=floor": (f"adakv:kernel={KERNEL}:pooling=avg:rule=floor", "adakv"),
    "keydiff (window 32)": ("keydiff", "keydiff"),
    "expected-attention (window 32)": ("expected-attention", "expected"),
    "kvzip (our default)": ("kvzip", "kvzip"),
    "criticaladakv (FFY0 split)": (f"criticaladakv:kernel={KERNEL}:pooling=avg", "criticaladakv"),
    **CHUNK_EARLIER,
    "leverage:seed=1:window=0": ("leverage:seed=1:window=0", "leverage"),  # another sketch than kvpress's seeded one
    "compactor (window 32)": ("compactor", "compactor"),
    "kvcompose (exact count)": ("kvcompose:window=0", "kvcompose"),
}
ROUNDED = {"kvcompose:rounding=kvpress": "kvcompose"}  # kvpress's own counts: the drift from L x H x B is printed


# --------------------------------------------------------------------------- the reference venv (reference_venv.py)


def parse_reference_budgets(text: str) -> list[int]:
    """--budgets as the comparison takes them: positive integers above the window, comma-separated."""
    from ripplekv.errors import UserError
    from ripplekv.pipeline.eval_plan import parse_budgets

    budgets = list(parse_budgets([text]))
    if any(b <= WINDOW for b in budgets):
        raise UserError(f"--budgets must exceed the window ({WINDOW}) for the comparison, got {text}")
    return budgets


# --------------------------------------------------------------------------- the rules re-implemented


def ffy0_rule(scores: np.ndarray, budget: int, window: int, alpha: float = 0.2):
    """AdaKV's allocation (FFY0/AdaKV, AdaptiveSnapKVCluster): kept prefix sets per head, exact totals.

    c_h = head h's share of the layer's top H*base scores; head h keeps its top
    (1-alpha) c_h + alpha base, rounded by largest remainder (ties to the lower head) to sum to H*base.
    Also returns FFY0's own per-head round (which may not sum exactly), for information.
    """
    heads, m = scores.shape
    base = budget - window
    flat = np.argsort(-scores.reshape(-1), kind="stable")[: heads * base]
    chosen = np.bincount(flat // m, minlength=heads)
    target = (1 - alpha) * chosen + alpha * base
    counts = np.floor(target).astype(int)
    for h in sorted(range(heads), key=lambda h: (-(target[h] - counts[h]), h))[: heads * base - counts.sum()]:
        counts[h] += 1
    own_round = np.round(chosen * (1 - alpha) + int(base * alpha)).astype(int)
    kept = [set(np.argsort(-scores[h], kind="stable")[: counts[h]].tolist()) for h in range(heads)]
    return kept, counts, own_round


def pyramid_formula(layers: int, budget: int, window: int, beta: float = 20.0) -> np.ndarray:
    """PyramidKV's schedule (Cai et al. 2024): window + an arithmetic sequence of prefix budgets from
    (2 - 1/beta)(B - w) at layer 0 down to (B - w)/beta at the last layer (mean B - w)."""
    base = budget - window
    top, bottom = (2 - 1 / beta) * base, base / beta
    return window + top - (top - bottom) * np.arange(layers) / (layers - 1)


def kvcache_factory_pyramid(layers: int, budget: int, window: int, length: int, beta: int = 20) -> np.ndarray:
    """KVCache-Factory's integer version of the same schedule (integer steps; its total drifts)."""
    base = budget - window
    low = base // beta
    high = base * 2 - low
    if high >= length - window:
        high = length - window
        low = base * 2 - high
    steps = (high - low) // (layers - 1)
    return np.asarray([window + high - layer * steps for layer in range(layers)])


def cakekv_budgets(prefs: np.ndarray, budget: int, window: int, length: int, tau1=1.0, tau2=1.0) -> np.ndarray:
    """cakekv's layer budgets: window + int(P_l / sum P * L (B - w)), then its adjust_budgets (cap at
    n - w, hand out the excess and the shortfall evenly, the remainder to the first layers)."""
    layers = len(prefs)
    total = (budget - window) * layers
    pref = prefs[:, 0] ** (1 / tau1) * prefs[:, 1] ** (1 / tau2)
    counts = np.array([int(p / pref.sum() * total) for p in pref])
    cap = length - window
    excess = np.maximum(counts - cap, 0).sum()
    counts = np.minimum(counts, cap)
    if excess > 0:
        valid = np.where(counts < cap)[0]
        if len(valid):
            counts[valid] += excess // len(valid)
            counts[valid[: excess % len(valid)]] += 1
    diff = total - counts.sum()
    if diff != 0:
        valid = np.where(counts < cap)[0] if diff > 0 else np.where(counts > 1)[0]
        if len(valid):
            step = abs(diff) // len(valid)
            counts[valid] += np.sign(diff) * step
            counts[valid[: abs(diff) % len(valid)]] += np.sign(diff)
    return counts + window


# --------------------------------------------------------------------------- our side and the comparison


def budgets_of(name: str, budgets: list[int]) -> list[int]:
    """The budgets a pair is compared at: kvpress's pyramid also at PYRAMID_BUDGET, where it is one."""
    return budgets + [PYRAMID_BUDGET] if name == "pyramidkv:schedule=kvpress" and PYRAMID_BUDGET not in budgets else budgets


def our_side(args, out: Path) -> tuple[int, list[int]]:
    """Prompts' ids (prompt_*.npy) and our kept sets (ours_*.npz, inspect's kept.npz layout); (layers, lengths)."""
    import torch

    from ripplekv.analysis.kept import kept_arrays
    from ripplekv.engine.models import load_model
    from ripplekv.engine.prefill import Requirements, prefill_for
    from ripplekv.engine.recorders import SampleContext
    from ripplekv.methods import make_method
    from ripplekv.tasks import build_prompt_ids, get_tasks, load_samples
    from ripplekv.tasks.prompts import question_start

    model, tokenizer, _ = load_model(None, device="cpu", dtype="float32")
    budgets = [int(b) for b in args.budgets.split(",")]
    pairs = {name: spec for name, (spec, _) in {**PAIRS, **EARLIER}.items() if name not in LEARNED or name in args.learned}
    pairs = {name: spec for name, spec in pairs.items() if args.only is None or name in args.only}
    axes = [name for name in AXES if args.only is None or name in args.only]  # check_references_axes' own pass
    methods = {name: make_method(spec) for name, spec in pairs.items()}
    if args.only is None:
        methods["cake"] = make_method("cake")
        methods.update({name: make_method(name) for name in ("dynamickv", "lava")})  # check_references_allocators
    needs = Requirements.of_all([*methods.values(), *(make_method(AXES[name]) for name in axes)])
    lengths, cuts = [], {}
    for index, task in enumerate(get_tasks("offline")[: args.prompts]):
        record = load_samples(task, tokenizer, limit=1, target_tokens=args.target_tokens)[0]
        ids = build_prompt_ids(task, record, tokenizer, 7500)
        np.save(out / f"prompt_{index}.npy", np.asarray(ids, dtype=np.int64))
        cuts[f"prompt_{index}"] = question_start(task, record, tokenizer, 7500)  # Finch's question part
        (out / "questions.json").write_text(json.dumps(cuts))
        state = prefill_for(model, ids, needs, context=SampleContext(tokenizer=tokenizer, question_at=cuts[f"prompt_{index}"]))
        lengths.append(state.length)
        if args.only is None:
            save_kv(state, out, index)  # for optimum-quanto's quantize-dequantize (check_references_quant)
        if axes:
            save_ours(state, out, index, budgets, axes)
        arrays = {}
        with torch.no_grad():
            for name, method in methods.items():
                for budget in budgets_of(name, budgets):
                    kept = kept_arrays(method.compress(state, budget))
                    arrays[f"{name}/{budget}/positions"] = kept["positions"]
                    arrays[f"{name}/{budget}/counts"] = kept["counts"]
        np.savez_compressed(out / f"ours_prompt_{index}.npz", **arrays, meta=json.dumps({"task": task.name, "tokens": state.length}))
        print(f"ours: prompt {index} ({task.name}, {state.length} tokens) done", file=sys.stderr)
    return model.config.num_hidden_layers, lengths


def our_pyramid(budget: int, length: int) -> np.ndarray:
    """PyramidKV's layer budgets as `ripplekv budgets` prints them (the public surface)."""
    command = [sys.executable, "-m", "ripplekv.cli", "budgets", "--methods", "pyramidkv", "--budget", str(budget),
               "--prompt-len", str(length), "--format", "csv"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"`{' '.join(command[1:])}` failed:\n{done.stderr}")
    text = done.stdout
    import csv
    import io

    rows = [row for row in csv.DictReader(io.StringIO(text)) if row.get("method") == "pyramidkv"]
    column = next(key for key in rows[0] if key not in ("method", "layer"))
    return np.asarray([int(row[column]) for row in sorted(rows, key=lambda r: int(r["layer"]))])


def kept_sets(positions: np.ndarray) -> list[list[set[int]]]:
    return [[set(int(p) for p in row if p >= 0) for row in layer] for layer in positions]


def tied_swap(scores: np.ndarray | None, head: int, kept: set[int], theirs: set[int]) -> bool:
    """Whether two kept sets of one head differ only by entries of equal score (which of tied entries a top-k keeps
    is not specified: ours keeps the earliest, `methods.core.base.top_indices`). Key norms tie exactly where two positions
    hold the same token's key in layer 0 (RoPE leaves norms unchanged); KVzip's reconstruction scores where no
    query attends (kvpress leaves the chat template's opening at 0)."""
    if scores is None or len(kept) != len(theirs):
        return False
    row = scores[head]
    scored = len(row)  # a press's scores may stop short of the window it always keeps: those entries must match
    if {p for p in kept if p >= scored} != {p for p in theirs if p >= scored}:
        return False
    return sorted(row[sorted(p for p in kept if p < scored)].tolist()) == \
        sorted(row[sorted(p for p in theirs if p < scored)].tolist())


def count_note(ours_files, name: str, budgets: list[int], exact: str) -> str:
    """How far a press's own counts (a pair with `rounding=kvpress`) move the total from L x H x B."""
    drifts = [np.load(path)[f"{name}/{b}/counts"].mean() / b - 1 for path in ours_files for b in budgets]
    return f"; kvpress's counts keep {min(drifts):+.2%} to {max(drifts):+.2%} of L x H x B (`{exact}`, exact, keeps it)"


def lazy_note(ours_files, name: str, budget: int) -> str:
    """How many layers SimLayerKV found lazy on each prompt (a lazy layer keeps less than the prompt)."""
    counts = []
    for path in ours_files:
        ours = np.load(path)
        length = int(json.loads(str(ours["meta"]))["tokens"])
        counts.append(int((ours[f"{name}/{budget}/counts"].max(1) < length).sum()))
    return f"; lazy layers per prompt {counts} (threshold {SIMLAYERKV_THRESHOLD})"


def compare(out: Path, layers: int, lengths: list[int], budgets: list[int], only=None) -> list[tuple[str, bool, str]]:
    lines = []
    ours_files = sorted(out.glob("ours_prompt_*.npz"))
    first = np.load(ours_files[0])
    pairs = {name: pair for name, pair in {**PAIRS, **EARLIER}.items() if f"{name}/{budgets[0]}/positions" in first.files
             and (only is None or name in only)}
    partial = only is not None or f"cake/{budgets[0]}/counts" not in first.files  # a run with --only
    stats = {name: [] for name in pairs}
    own_round_agree = []
    cake_diffs = []
    for ours_path in ours_files:
        ours = np.load(ours_path)
        ref = np.load(out / f"reference_{ours_path.stem[len('ours_'):]}.npz")
        for name, (_, key) in pairs.items():
            for budget in budgets_of(name, budgets):
                mine = kept_sets(ours[f"{name}/{budget}/positions"])
                for layer in range(layers):
                    if key == "adakv":
                        theirs, _, own = ffy0_rule(ref[f"snapkv_scores/{layer}"], budget, WINDOW)
                        n = ref[f"snapkv_scores/{layer}"].shape[1] + WINDOW
                        theirs = [t | set(range(n - WINDOW, n)) for t in theirs]
                        if name == "adakv":
                            own_round_agree.extend((own + WINDOW == ours[f"{name}/{budget}/counts"][layer]).tolist())
                    else:
                        theirs = [set(int(p) for p in row if p >= 0) for row in ref[f"{key}/{budget}/{layer}"]]
                    scores = ref[f"{key}_scores/{layer}"] if f"{key}_scores/{layer}" in ref.files else None
                    for head, kept in enumerate(mine[layer]):
                        union = kept | theirs[head]
                        stats[name].append((kept == theirs[head], len(kept & theirs[head]) / max(len(union), 1),
                                            kept == theirs[head] or tied_swap(scores, head, kept, theirs[head])))
        for budget in budgets if not partial else ():
            length = int(json.loads(str(ours["meta"]))["tokens"])
            cake_ref = cakekv_budgets(ref["cake_prefs"], budget, WINDOW, length)
            cake_ours = ours[f"cake/{budget}/counts"][:, 0]
            cake_diffs.append((int(np.abs(cake_ref - cake_ours).max()), int(cake_ours.sum()) == layers * budget,
                               int(cake_ref.sum()) - layers * budget))
    for name, values in stats.items():
        same = np.mean([v[0] for v in values])
        jaccard = np.mean([v[1] for v in values])
        tied = np.mean([v[2] for v in values])
        extra = f"; FFY0's own per-head round gives the same counts in {np.mean(own_round_agree):.3f} of heads" if name == "adakv" else ""
        extra += lukv_drift(ours_files, layers, budgets) if name == "lukv" else ""
        extra += lazy_note(ours_files, name, budgets[0]) if name.startswith("simlayerkv") else ""
        extra += threshold_note(ours_files, name, budgets[0]) if name in THRESHOLD_PAIRS else ""
        extra += duo_note(ours_files, name, budgets) if name in DUO_PAIRS else ""
        extra += count_note(ours_files, name, budgets, ROUNDED[name]) if name in ROUNDED else ""
        extra += f" (B = {','.join(map(str, budgets_of(name, budgets)))})" if budgets_of(name, budgets) != budgets else ""
        if name in EARLIER:
            lines.append((name, None, f"  (not the reference's setting) {name}: identical {same:.4f}, mean Jaccard {jaccard:.4f}"))
            continue
        ties = f"; identical up to tied scores {tied:.4f}" if tied > same else ""
        lines.append((name, max(same, tied) >= 0.99, f"{name:<14} identical kept sets {same:.4f} of {len(values)} (layer, KV head, "
                      f"prompt, budget){ties}; mean Jaccard {jaccard:.4f}{extra}"))
    if partial:
        return lines
    worst = max(d[0] for d in cake_diffs)
    lines.append(("cake", worst <= 1 and all(d[1] for d in cake_diffs),
                  f"{'cake':<14} layer budgets vs cakekv's formula on the reference attention: max |diff| {worst} entries "
                  f"per layer over {len(cake_diffs)} (prompt, budget); ours sum exactly to L x B: {all(d[1] for d in cake_diffs)}; "
                  f"cakekv's totals off by {sorted({d[2] for d in cake_diffs})}"))
    pyramid = []
    for budget in budgets:
        length = max(lengths)
        mine = our_pyramid(budget, length)
        formula = pyramid_formula(layers, budget, WINDOW)
        factory = kvcache_factory_pyramid(layers, budget, WINDOW, length)
        pyramid.append((float(np.abs(mine - formula).max()), int(mine.sum()) == layers * budget,
                        int(np.abs(mine - factory).max()), int(factory.sum()) - layers * budget))
    worst = max(p[0] for p in pyramid)
    lines.append(("pyramidkv", worst < 1 and all(p[1] for p in pyramid),
                  f"{'pyramidkv':<14} layer budgets vs the paper's schedule: max |diff| {worst:.2f} entries per layer "
                  f"(B={','.join(map(str, budgets))}); ours sum exactly: {all(p[1] for p in pyramid)}; "
                  f"KVCache-Factory's integer steps differ by up to {max(p[2] for p in pyramid)} and their totals "
                  f"by {[p[3] for p in pyramid]} entries per head"))
    from check_references_allocators import compare_allocators

    lines += compare_allocators(ours_files, lambda path: np.load(out / f"reference_{path.stem[len('ours_'):]}.npz"),
                                layers, budgets)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="offline-suite prompts (one per task)")
    parser.add_argument("--budgets", default="128,512")
    parser.add_argument("--target-tokens", type=int, default=3500)
    parser.add_argument("--venv", default=default_venv(),
                        help="the reference venv (default: .refvenv in the project, or RIPPLEKV_REFVENV); made when missing")
    parser.add_argument("--out", default="runs/check-references")
    parser.add_argument("--only", help="compare only these pairs, comma-separated names as printed (e.g. finch,kvgrad); "
                                       "the allocator, schedule and quantizer lines are left out")
    parser.add_argument("--keys", help=argparse.SUPPRESS)  # the worker's share of --only: the reference keys
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from check_references_worker import worker

        worker(args)
        return
    one_line(lambda: check_and_compare(args))


def parse_only(text: str | None) -> set[str] | None:
    """--only as a set of pair names; one line naming any that is not a pair."""
    from ripplekv.errors import UserError

    if text is None:
        return None
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(PAIRS) - set(EARLIER) - set(AXES))
    if unknown or not names:
        raise UserError(f"--only takes pair names ({', '.join([*PAIRS, *AXES])}), got {', '.join(unknown) or 'nothing'}")
    return names


def check_and_compare(args) -> None:
    """Every option (budgets, prompts, the venv's path, the output folder) before anything is made, then the run."""
    from ripplekv.errors import UserError
    from ripplekv.runs.safeio import check_output

    budgets = parse_reference_budgets(args.budgets)
    args.budgets = ",".join(map(str, budgets))
    args.only = parse_only(args.only)
    if args.prompts < 1 or args.target_tokens < 1:
        raise UserError(f"--prompts and --target-tokens must be at least 1, got {args.prompts} and {args.target_tokens}")
    if args.target_tokens < PYRAMID_BUDGET + 64:
        raise UserError(f"--target-tokens must be at least {PYRAMID_BUDGET + 64}: kvpress's pyramid is checked at "
                        f"B = {PYRAMID_BUDGET}")
    check_venv_path(args.venv)
    out = check_output(args.out, kind="dir")
    python = ensure_venv(Path(args.venv))
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.npz"), *out.glob("*.npy"), *out.glob("kvzap*.safetensors"), *out.glob("qfilter*.safetensors"),
                *out.glob("duoattention*.json"), *out.glob("fastkvzip*.safetensors")]:
        old.unlink()
    from ripplekv.engine.models import _source_and_location

    _, model_dir = _source_and_location(None)
    has_curve, surrogates, filters = shipped_curve(out), shipped_surrogates(out) + shipped_gates(out), shipped_filters(out)
    duo = shipped_duo_gates(out)
    args.learned = ({"lukv"} if has_curve else set()) | set(surrogates) | set(filters) | set(duo)
    layers, lengths = our_side(args, out)
    asked = sorted({{**PAIRS, **EARLIER}[n][1] for n in args.only or () if n in PAIRS or n in EARLIER})
    keys = [] if args.only is None else ["--keys", ",".join(asked) or "none"]  # "none": the axes' pass alone
    subprocess.run([str(python), os.path.abspath(__file__), "--worker", "--model-dir", model_dir, "--out", str(out),
                    "--budgets", ",".join(map(str, budgets_of("pyramidkv:schedule=kvpress", budgets))), *keys], check=True,
                   env={**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"})
    lines = compare(out, layers, lengths, budgets, args.only) + compare_axes(out, layers, budgets)
    versions = json.loads((out / "reference_versions.json").read_text())
    lines += compare_quantizers(out, versions["optimum-quanto"]) if args.only is None else []
    for big in [*out.glob("kv_prompt_*.npy"), *out.glob("quanto_prompt_*.npz")]:
        big.unlink()  # the full K/V and its dequantized copies (hundreds of MB a prompt)
    print(f"reference code: kvpress {versions['kvpress']}, optimum-quanto {versions['optimum-quanto']}, "
          f"transformers {versions['transformers']}, torch {versions['torch']}; "
          f"{len(lengths)} prompts ({min(lengths)}-{max(lengths)} tokens), B = {args.budgets}")
    for line in missing_lines(has_curve, surrogates, duo) + missing_line(filters):
        print(line)
    for _, _, text in sorted(lines, key=lambda line: line[1] is None):
        print(text)
    checked = [ok for _, ok, _ in lines if ok is not None]
    print(f"reference parity: {sum(checked)}/{len(checked)} methods >= 0.99")
    sys.exit(0 if all(checked) else 1)


if __name__ == "__main__":
    main()
