"""Timing against kvpress itself: its own loop per (press, budget) vs `ripplekv eval` for the same work.

Two processes, as in `check_references.py`:
- the peer (`--worker`, in the reference venv: kvpress 0.5.5, transformers 5.2.0, same CPU torch) loads the
  bundled model's dequantized weights once (sdpa; eager for ObservedAttention, as kvpress's evaluation
  does) and runs, for every prompt, the full cache and every press x budget as kvpress's pipeline does:
  prefill under `with press(model)` through `model.model`, then greedy decoding at batch 1 over the
  compressed cache. The whole prompt is the context, as our with-question protocol compresses it;
  decoding stops at the same stop tokens as ours.
- ours (this process, the project's venv): `ripplekv eval` in-process (`pipeline.evaluate.run_eval`, report
  included) on the same prompts, methods and budgets, into a fresh directory each time.
Model loading is outside the clock on both sides (ours is loaded once and handed to eval). Each repeat runs
both, the order alternating, so a change in background load hits both.

Method sets (each at every budget, 2 by default):
- "22 variants": the 11 methods both have, configured alike: streamingllm (StreamingLLMPress), snapkv
  (SnapKVPress), pyramidkv (PyramidKVPress), tova (TOVAPress), knorm (KnormPress), expected-attention
  (ExpectedAttentionPress), keydiff (KeyDiffPress), criticalkv (CriticalKVPress over SnapKV), adakv
  (AdaKVPress over SnapKV), kvzip (KVzipPress), h2o:norm=mean:recent=0 (ObservedAttentionPress).
- "8 cheap variants": streamingllm, snapkv, pyramidkv, tova (the issue's 4 x 2).
- "issue 63 presses" (26 variants, not run unless `--sets` or `--methods` names them): chunkkv, eg-chunkkv,
  chunkpress, lagkv, leverage, noncausal, compactor, cur, capkv, kvcompose, finch, kvgrad and
  simlayerkv:reading=threshold against their presses, each spec and press set up as make check-references
  pairs them (`PRESSES_63`, `set_up`): Finch is told the question part (the task's split) in place of a
  delimiter token and keeps its keys at their positions (`rerotate_keys=False`, as ours); the sketches of
  Leverage and Compactor are seeded per layer; SimLayerKV's threshold reading keeps the same at every budget.
- the curve (`--curve`, default 1, 2, 4, 8, 16, 22): ours timed again on the first N variants (methods in
  the order above, each at every budget; 8 is the cheap set and 22 the whole one, whose runs are reused), each
  against kvpress's runs of the same variants, for the speedup against the number of variants (*_curve.csv).
Both sides also run the full cache once per prompt. kvpress's time for a set is the sum of its runs (each
variant is a separate run in its loop); ours is one eval of the set. Printed per set: `peer/ours` (total
over repeats), and per method the share of (prompt, budget) whose greedy answers are the same text.
Kept sets are compared by `make check-references` (on its own prompts); its lines for these methods are
printed from its output directory (`--kept-from`) when one is there. kvpress keeps AdaKV's and KVzip's unequal heads
by masking a full-length cache: that is the peer's own cost, measured as it is. Each of our specs is the one that
reproduces its press (kvpress's PyramidKV schedule, no window for Expected Attention, KeyDiff and KVzip, KVzip's
chat-template start and entry-level global budget: docs/methods.md).

    PYTHONPATH=src .venv/bin/python scripts/bench_peer.py [--prompts 2] [--target-tokens 3500] [--repeats 2]
        [--budgets 128,512] [--sets "22 variants,8 cheap variants"] [--methods snapkv,tova] [--out CSV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WINDOW, KERNEL = 32, 5  # SnapKV's window and pooling kernel, the same on both sides
SNAP = ("SnapKVPress", {"window_size": WINDOW, "kernel_size": KERNEL})
# our spec -> (kvpress press, its arguments; a nested tuple is a press it wraps), configured as the spec
METHODS = {
    "streamingllm": ("StreamingLLMPress", {"n_sink": 4}),
    f"snapkv:kernel={KERNEL}:pooling=avg": SNAP,
    f"pyramidkv:kernel={KERNEL}:pooling=avg:schedule=kvpress": ("PyramidKVPress", {"window_size": WINDOW, "kernel_size": KERNEL}),
    "tova": ("TOVAPress", {}),
    "knorm": ("KnormPress", {}),
    "expected-attention:window=0": ("ExpectedAttentionPress", {}),
    "keydiff:window=0": ("KeyDiffPress", {}),
    f"criticalkv:kernel={KERNEL}:pooling=avg": ("CriticalKVPress", {"press": SNAP}),
    f"adakv:kernel={KERNEL}:pooling=avg:rule=kvpress": ("AdaKVPress", {"press": SNAP}),
    "kvzip:granularity=entry:skip_template=1:window=0": ("KVzipPress", {}),
    "h2o:norm=mean:recent=0": ("ObservedAttentionPress", {}),
}
# issue 63's presses, each spec its make check-references pair (Finch told the question part in place of a delimiter
# token, its keys not re-rotated, as ours; SimLayerKV's threshold reading keeps what its threshold gives at any budget)
PRESSES_63 = {
    f"chunkkv:kernel={KERNEL}:pooling=avg:chunk_rounding=kvpress": ("ChunkKVPress", {"press": SNAP, "chunk_length": 20}),
    "eg-chunkkv:scorer=expected-attention:window=0": ("EntropyGatedChunkKVPress", {"press": ("ExpectedAttentionPress", {})}),
    "chunkpress:scorer=knorm:chunk_rounding=kvpress": ("ChunkPress", {"press": ("KnormPress", {}), "chunk_length": 1024}),
    "lagkv": ("LagKVPress", {}),
    "leverage:window=0": ("LeverageScorePress", {}),
    "noncausal:window=0": ("NonCausalAttnPress", {}),
    "compactor:window=0": ("CompactorPress", {}),
    "cur:window=0": ("CURPress", {}),
    "capkv:window=0": ("CapPress", {}),
    "kvcompose:window=0": ("KVComposePress", {}),
    "finch": ("FinchPress", {"rerotate_keys": False}),
    "kvgrad:granularity=entry:skip_template=1:window=0": ("KVgradPress", {}),
    "simlayerkv:reading=threshold:lazy_threshold=0.9": ("SimLayerKVPress", {"lazy_threshold": 0.9}),
}
EVERY = {**METHODS, **PRESSES_63}  # every spec a set or --methods can name
WHOLE_CHUNKS = ("ChunkKVPress", "ChunkPress")  # count whole chunks at ratio 1 - B/n (check_references_chunks)
SEEDED = ("LeverageScorePress", "CompactorPress")  # draw a sketch: seeded with the layer, as ours (check_references_worker)
CHEAP = ("streamingllm", "snapkv", "pyramidkv", "tova")
CURVE = (1, 2, 4, 8, 16, 22)  # --curve's default points: variants timed (the first of the sets' methods x budgets)
EAGER = ("ObservedAttentionPress",)  # presses that read the attention weights sdpa does not return
# Methods whose answers are not expected to match, and why (left out of the overall agreement line). Every spec is
# the one that reproduces its press (make check-references holds their kept sets); LagKV's agree only up to ties.
UNLIKE: dict[str, str] = {
    "lagkv": "its scores are ranks within each partition, so entries of different partitions tie by design and which "
             "of them a top-k keeps is unspecified (ours: the earliest); its kept sets agree with kvpress's only up to "
             "tied scores (check-references), so its answers need not",
}


def base(spec: str) -> str:
    """A spec's method name (`snapkv:kernel=5` -> `snapkv`)."""
    return spec.split(":", 1)[0]


SETS = {"22 variants": tuple(METHODS), "8 cheap variants": tuple(s for s in METHODS if base(s) in CHEAP),
        "issue 63 presses": tuple(PRESSES_63)}
DEFAULT_SETS = ("22 variants", "8 cheap variants")  # the headline run; the issue 63 set by --sets or --methods


def pick(names: str) -> tuple[str, ...]:
    """Our specs for comma-separated method names (`snapkv,tova`); an unknown name is one clear line."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {base(s) for s in EVERY}]
    if unknown:
        from ripplekv.errors import UserError

        raise UserError(f"--methods: {', '.join(unknown)} not in both (choose from {', '.join(base(s) for s in EVERY)})")
    return tuple(s for s in EVERY if base(s) in wanted)


def variants(specs, budgets) -> list[tuple[str, int]]:
    """The (method, budget) pairs of a set: every method at every budget."""
    return [(spec, budget) for spec in specs for budget in budgets]


def curve_grid(count: int, specs, budgets) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The methods and budgets of the first `count` variants of `specs` x `budgets` (method by method), as one
    eval runs them: a whole number of methods, or fewer variants than one method has budgets."""
    whole, part = divmod(count, len(budgets))
    if count < 1 or count > len(specs) * len(budgets) or (part and whole):
        from ripplekv.errors import UserError

        raise UserError(f"--curve: {count} variants is not 1..{len(budgets)} or a multiple of {len(budgets)} up to "
                        f"{len(specs) * len(budgets)} (the first methods at every budget)")
    return (specs[:1], tuple(budgets[:part])) if part else (tuple(specs[:whole]), tuple(budgets))


def keep_ratio(budget: int, length: int, press: str = "", entries: int = 0, layers: int = 1) -> float:
    """kvpress's compression_ratio that keeps `budget` entries per head of a `length`-token prompt: most presses
    keep int(length * (1 - ratio)) (AdaKV on average over heads); PyramidKV averages length * (1 - ratio) over its
    layers, KVzip and KVgrad keep all but int(entries * ratio) of the `entries` = L x H_kv x n, KVCompose keeps
    int(L n (1 - ratio)) token slots of its `layers` x n, and ChunkKV and ChunkPress count whole chunks at
    1 - B / n, as our `chunk_rounding=kvpress` does (check_references_worker)."""
    if press in ("KVzipPress", "KVgradPress"):
        return 1 - (entries * budget / length - 0.5) / entries
    if press == "KVComposePress":
        return 1 - (layers * budget + 0.5) / (layers * length)
    if press == "PyramidKVPress" or press in WHOLE_CHUNKS:
        return 1 - budget / length
    return 1 - (budget + 0.5) / length


def ratios(times, sets: dict) -> list[dict]:
    """peer/ours per set from per-repeat timings: rows {set, repeat, peer_s, ours_s}; totals over repeats."""
    import pandas as pd

    frame = pd.DataFrame(times)
    rows = []
    for name in sets:
        part = frame[frame["set"] == name]
        if part.empty:
            continue
        peer, ours = part["peer_s"].sum(), part["ours_s"].sum()
        rows.append({"set": name, "repeats": len(part), "peer_s": peer, "ours_s": ours, "peer/ours": peer / ours,
                     "range": f"{(part['peer_s'] / part['ours_s']).min():.2f}-{(part['peer_s'] / part['ours_s']).max():.2f}"})
    return rows


def cut_at_stop(tokens: list[int], stops) -> list[int]:
    """Tokens before the first stop token (the answer as text, whichever side kept the stop)."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[:index]
    return tokens


def kept_lines(directory: Path) -> list[str]:
    """check-references' kept-set lines for the methods both have, from the files a `make check-references`
    left in `directory` (its prompts and budgets, not this run's: kept sets need its position trick)."""
    import numpy as np
    from check_references import PAIRS, compare

    files = sorted(directory.glob("ours_prompt_*.npz"))
    if not files or not list(directory.glob("reference_prompt_*.npz")):
        return [f"kept sets: no check-references files in {directory} (run make check-references, or give --kept-from)"]
    first = np.load(files[0])
    kept = [key for key in first.files if key.endswith("/positions")]  # any pair's: an `--only` run has some
    budgets = sorted({int(key.split("/")[-2]) for key in kept})
    layers = first[kept[0]].shape[0]
    lengths = [int(json.loads(str(np.load(path)["meta"]))["tokens"]) for path in files]
    lines = [text for name, _, text in compare(directory, layers, lengths, budgets) if name in PAIRS]
    return [f"kept sets (check-references in {directory}: {len(files)} prompts, B = {budgets}):", *lines]


# --------------------------------------------------------------------------- the peer (reference venv)


def make_press(entry):
    import kvpress

    name, options = entry
    options = {key: make_press(value) if isinstance(value, tuple) else value for key, value in options.items()}
    return getattr(kvpress, name)(**options)


def set_up(press, budget: int, n: int, question_at: int | None, config) -> None:
    """What the pipeline leaves to its caller, set as check-references sets it: the compression ratio for the
    budget (SimLayerKV has none), Finch's question part (no delimiter token: its hook never fires), the sketch
    seeded per layer and Compactor's blending at 1 - B/n."""
    import torch

    kind = type(press).__name__
    if kind != "SimLayerKVPress":
        layers = config.num_hidden_layers
        press.compression_ratio = keep_ratio(budget, n, kind, layers * config.num_key_value_heads * n, layers)
    if kind == "FinchPress":
        press.delimiter_token_id, press.window_size = -1, n - question_at
    if kind in SEEDED:
        own = press.compress

        def seeded(module, *args):
            torch.manual_seed(module.layer_idx)
            return own(module, *args)

        press.compress = seeded
    if kind == "CompactorPress":
        press.blending = 1 - budget / n


def peer_run(model, ids, press, budget, max_new_tokens, stops, question_at=None) -> list[int]:
    """One variant as kvpress's pipeline runs it: prefill under the press (model.model, no lm head over the
    prompt), then greedy decoding at batch 1, positions continuing after the uncompressed prompt."""
    import contextlib

    import torch
    from transformers import DynamicCache

    n = ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        if press is not None:
            set_up(press, budget, n, question_at, model.config)
        with press(model) if press is not None else contextlib.nullcontext():
            hidden = model.model(input_ids=ids, past_key_values=cache).last_hidden_state
        token = model.lm_head(hidden[:, -1]).argmax(-1)
        tokens = [int(token)]
        for step in range(max_new_tokens - 1):
            if tokens[-1] in stops:
                break
            out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[n + step]]))
            token = out.logits[0, -1].argmax(-1)
            tokens.append(int(token))
    return tokens


def worker(model_dir: str, threads: int | None) -> None:
    """Load once, then answer one JSON request a line on stdin: {prompt, press, budget, max_new_tokens, stops}."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    peer_run(model, torch.arange(100, 164)[None], None, 0, 2, set())  # warm-up, outside any clock
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        ids = torch.as_tensor(np.load(job["prompt"]), dtype=torch.long)[None]
        entry = EVERY.get(job["press"])
        press = None if entry is None else make_press(entry)
        eager = entry is not None and entry[0] in EAGER
        if eager:
            model.set_attn_implementation("eager")
        start = time.perf_counter()
        tokens = peer_run(model, ids, press, job["budget"], job["max_new_tokens"], set(job["stops"]), job.get("question_at"))
        seconds = time.perf_counter() - start
        if eager:
            model.set_attn_implementation("sdpa")
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


class Peer:
    """The worker process, driven a run at a time."""

    def __init__(self, python: Path, model_dir: str, threads: int | None):
        env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
        command = [str(python), os.path.abspath(__file__), "--worker", "--model-dir", model_dir]
        self.process = subprocess.Popen(command + (["--threads", str(threads)] if threads else []),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.read()

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"the kvpress worker stopped (exit {self.process.wait()}); its error is above")
        return json.loads(line)

    def run(self, **job) -> dict:
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# --------------------------------------------------------------------------- ours, and the driver


def ours(settings, loaded, out: Path) -> tuple[float, list[dict]]:
    """Wall time of `ripplekv eval` (report included) with the model already loaded, and its result lines."""
    import io
    from unittest import mock

    from rich.console import Console

    from ripplekv.pipeline.evaluate import run_eval

    start = time.perf_counter()
    with mock.patch("ripplekv.engine.models.load_model", return_value=loaded):
        run_eval(settings, out, console=Console(file=io.StringIO()))
    seconds = time.perf_counter() - start
    return seconds, [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="offline-suite prompts (the first task's sample, ...)")
    parser.add_argument("--target-tokens", type=int, default=3500)
    parser.add_argument("--budgets", default="128,512")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sets", default=",".join(DEFAULT_SETS),
                        help=f"method sets to time, comma-separated (of: {', '.join(SETS)})")
    parser.add_argument("--methods", help="time only these methods (names, e.g. snapkv,tova) as one set")
    parser.add_argument("--curve", default=None,
                        help="also time ours on the first N variants, comma-separated (speedup against the number of "
                             "variants, written beside --out as *_curve.csv); default 1,2,4,8,16,22 up to the sets' "
                             "variants, '' for none")
    parser.add_argument("--venv", default=None,
                        help="the reference venv (default: .refvenv in the project, or RIPPLEKV_REFVENV); made when missing")
    parser.add_argument("--out", default="runs/bench-peer/bench_peer.csv")
    parser.add_argument("--kept-from", default="runs/check-references",
                        help="a check-references output directory whose kept-set comparison is printed too")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads on both sides (default: torch's choice); 1 avoids oversubscription on a busy machine")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model_dir, args.threads)
        return
    from reference_venv import one_line

    one_line(lambda: run(args))


def run(args) -> None:
    import tempfile
    from dataclasses import replace

    import numpy as np
    import pandas as pd
    import torch
    from reference_venv import check_venv_path, default_venv, ensure_venv
    from rich.console import Console
    from rich.table import Table

    from ripplekv.engine.decode import stop_tokens
    from ripplekv.engine.models import _source_and_location, load_model
    from ripplekv.errors import UserError
    from ripplekv.pipeline.eval_plan import EvalSettings, parse_budgets, plan_eval
    from ripplekv.pipeline.evaluate import load_all_samples
    from ripplekv.runs.safeio import check_output
    from ripplekv.tasks import build_prompt_ids, get_tasks
    from ripplekv.tasks.prompts import question_start

    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = parse_budgets([args.budgets])
    if any(b <= WINDOW for b in budgets):
        raise UserError(f"--budgets must exceed the window ({WINDOW}), got {args.budgets}")
    if args.prompts < 1 or args.repeats < 1 or args.target_tokens < 1:
        raise UserError("--prompts, --repeats and --target-tokens must be at least 1")
    if args.methods:
        sets = {f"{len(pick(args.methods)) * len(budgets)} variants ({args.methods})": pick(args.methods)}
    else:
        chosen = [s.strip() for s in args.sets.split(",") if s.strip()]
        if [s for s in chosen if s not in SETS]:
            raise UserError(f"--sets: choose from {', '.join(SETS)}")
        sets = {name: SETS[name] for name in chosen}
    union = list(dict.fromkeys(spec for specs in sets.values() for spec in specs))
    counts = CURVE if args.curve is None else [int(x) for x in args.curve.split(",") if x.strip().isdigit()]
    if args.curve is None:
        counts = [c for c in counts if c <= len(union) * len(budgets)]
    elif len(counts) != len([x for x in args.curve.split(",") if x.strip()]):
        raise UserError(f"--curve takes numbers of variants, comma-separated, e.g. 1,2,4; got {args.curve!r}")
    grids = {count: curve_grid(count, union, budgets) for count in sorted(set(counts))}
    venv = check_venv_path(args.venv or default_venv())  # before anything is made: the venv, then the output
    out = check_output(args.out, kind="file")
    python = ensure_venv(venv)
    out.parent.mkdir(parents=True, exist_ok=True)
    tasks = tuple(task.name for task in get_tasks("offline")[: args.prompts])
    settings = {name: EvalSettings(budgets=budgets, methods=specs, tasks=tasks, limit=1, target_tokens=args.target_tokens,
                                   device="cpu", dtype="float32") for name, specs in sets.items()}
    any_settings = next(iter(settings.values()))
    loaded = load_model(None, device="cpu", dtype="float32")
    model, tokenizer, _ = loaded
    work = load_all_samples(plan_eval(any_settings), tokenizer)
    scratch = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    prompts = []
    for index, (task, sid, record) in enumerate(work):
        path = scratch / f"prompt_{index}.npy"
        ids = build_prompt_ids(task, record, tokenizer, any_settings.max_length)
        np.save(path, np.asarray(ids, dtype=np.int64))
        prompts.append({"task": task.name, "sid": sid, "path": str(path), "tokens": len(ids),
                        "max_new_tokens": task.max_new_tokens, "stops": stop_tokens(model, tokenizer, task.stop_at_newline),
                        "question_at": question_start(task, record, tokenizer, any_settings.max_length)})  # Finch's part
    with torch.no_grad():  # our warm-up, as the worker's
        model(torch.arange(100, 164)[None])
    _, model_dir = _source_and_location(None)
    peer = Peer(python, model_dir, args.threads)
    console = Console(width=max(Console().width, 130))
    console.print(f"{len(prompts)} prompts ({', '.join(str(p['tokens']) for p in prompts)} tokens), budgets "
                  f"{list(budgets)}, {args.repeats} repeats, torch threads {torch.get_num_threads()}, load "
                  f"{os.getloadavg()[0]:.1f}")
    records, times, curve = [], [], []
    for repeat in range(args.repeats):
        peer_first = repeat % 2 == 0
        for side in ("peer", "ours") if peer_first else ("ours", "peer"):
            if side == "peer":
                answers = {}
                for prompt in prompts:
                    for spec, budget in [("full", None), *variants(union, budgets)]:
                        result = peer.run(prompt=prompt["path"], press=spec, budget=budget, question_at=prompt["question_at"],
                                          max_new_tokens=prompt["max_new_tokens"], stops=prompt["stops"])
                        text = tokenizer.decode(cut_at_stop(result["tokens"], prompt["stops"]), skip_special_tokens=True)
                        answers[(prompt["sid"], spec, budget)] = (result["seconds"], text)
                console.print(f"repeat {repeat}: kvpress {sum(s for s, _ in answers.values()):.1f} s (load {os.getloadavg()[0]:.1f})")
            else:
                ours_runs = {}
                for name in sets:
                    seconds, rows = ours(settings[name], loaded, scratch / f"eval-{repeat}-{len(ours_runs)}")
                    ours_runs[name] = (seconds, rows)
                    console.print(f"repeat {repeat}: ripplekv eval, {name}: {seconds:.1f} s (load {os.getloadavg()[0]:.1f})")
                curve_s = {}
                for count, (specs, chosen) in grids.items():  # a point that is a whole set reuses its run
                    same = [name for name in sets if tuple(sets[name]) == specs and chosen == tuple(budgets)]
                    curve_s[count] = ours_runs[same[0]][0] if same else ours(
                        replace(any_settings, methods=specs, budgets=chosen), loaded, scratch / f"curve-{repeat}-{count}")[0]
                    console.print(f"repeat {repeat}: ripplekv eval, first {count} variants: {curve_s[count]:.1f} s")
        for name, specs in sets.items():
            wanted = {("full", None), *variants(specs, budgets)}
            peer_s = sum(s for (sid, spec, b), (s, _) in answers.items() if (spec, b) in wanted)
            times.append({"set": name, "repeat": repeat, "peer_s": peer_s, "ours_s": ours_runs[name][0]})
            for row in ours_runs[name][1]:
                spec = next((s for s in specs if base(s) == base(row["method"])), "full")
                seconds, text = answers[(row["id"], spec, row["budget"])]
                records.append({"repeat": repeat, "set": name, "sample": row["id"],
                                "method": spec, "budget": row["budget"], "kvpress_s": seconds,
                                "same_answer": text.strip() == row["prediction"].strip(),
                                "kvpress_answer": text, "ripplekv_answer": row["prediction"]})
        for count, (specs, chosen) in grids.items():
            wanted = {("full", None), *variants(specs, chosen)}
            curve.append({"variants": count, "repeat": repeat, "ours_s": curve_s[count],
                          "peer_s": sum(s for (sid, spec, b), (s, _) in answers.items() if (spec, b) in wanted)})
    peer.close()
    summary = ratios(times, sets)
    table = Table("set", "variants (+ full)", "prompts", "kvpress s", "ripplekv eval s", "peer/ours", "per repeat")
    for row in summary:
        table.add_row(row["set"], str(len(sets[row["set"]]) * len(budgets)), str(len(prompts)), f"{row['peer_s']:.1f}",
                      f"{row['ours_s']:.1f}", f"{row['peer/ours']:.2f}", row["range"])
    console.print(table)
    frame = pd.DataFrame(records)
    last = frame[frame["repeat"] == frame["repeat"].max()].drop_duplicates(["sample", "method", "budget"])
    agree = last.groupby("method", sort=False)["same_answer"].agg(["mean", "count"])
    table = Table("method", "same answer as kvpress", "of (prompt, budget)")
    for method, row in agree.iterrows():
        table.add_row(method, f"{row['mean']:.2f}", str(int(row["count"])))
    console.print(table)
    like = last[(last["method"] != "full") & ~last["method"].map(base).isin(UNLIKE)]
    console.print(f"answers: {like['same_answer'].mean():.3f} of {len(like)} compressed (prompt, method, budget) of "
                  f"like-for-like methods identical to kvpress's; full cache "
                  f"{last[last['method'] == 'full']['same_answer'].mean():.3f}", soft_wrap=True)
    for name, why in UNLIKE.items():
        if (last["method"].map(base) == name).any():
            console.print(f"not like-for-like: {name}: {why}", soft_wrap=True)
    for line in kept_lines(Path(args.kept_from)):
        console.print(line, soft_wrap=True, markup=False)
    frame.merge(pd.DataFrame(times), on=["set", "repeat"]).to_csv(out, index=False)
    console.print(f"wrote {out}")
    if curve:
        curve_out = out.with_name(f"{out.stem}_curve.csv")
        points = pd.DataFrame(curve)
        points.to_csv(curve_out, index=False)
        table = Table("variants (+ full)", "kvpress s", "ripplekv eval s", "peer/ours", title="speedup against the number of variants")
        for count, part in points.groupby("variants"):
            table.add_row(str(count), f"{part['peer_s'].sum():.1f}", f"{part['ours_s'].sum():.1f}",
                          f"{part['peer_s'].sum() / part['ours_s'].sum():.2f}")
        console.print(table)
        console.print(f"wrote {curve_out}")


if __name__ == "__main__":
    main()
