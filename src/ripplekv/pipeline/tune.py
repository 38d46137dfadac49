"""`ripplekv tune`: a baseline's knobs chosen on calibration prompts, the way RippleKV's ratio is chosen.

A grid is a method spec whose options list values: `cake:tau1=0.5,1,2:tau2=0.5,1,2`, `pyramidkv:beta=5,10,20,40`
(an option with one value is fixed). Each point is that method at those values, scored by teacher-forced KL to the
full cache's own answer on the calibration prompts of one draw at one budget; the lowest mean KL wins, and a pick at
an edge of the grid extends it (`pipeline.grid`), stopping where the method refuses a value. Every grid's points
are scored together from one prefill per prompt. An interrupted tune resumes per prompt (scratch logs beside the
output). Writes OUT.json (per method: the tuned spec, its grid and notes) and OUT.csv (every point's KL).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from ripplekv.errors import UserError
from ripplekv.pipeline.grid import Axis, GridSearch, grid_summary
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import UnitLog, check_output, write_csv, write_json
from ripplekv.tasks.calibration import Calibration

SWEEP_ANSWER_TOKENS = 32  # the full answer each calibration prompt decodes: the KL reference


@dataclass(frozen=True)
class TuneGrid:
    """One method's grid: its preset name, the options it fixes and the knobs it chooses among."""

    name: str
    fixed: tuple[tuple[str, str], ...]
    axes: tuple[Axis, ...]
    text: str

    @property
    def base(self) -> str:
        """The spec without the tuned knobs (what a --methods entry names when it means this method)."""
        return _spec(self.name, dict(self.fixed))

    def spec(self, point: dict[str, float]) -> str:
        return _spec(self.name, {**dict(self.fixed), **{k: f"{v:g}" for k, v in point.items()}})


def _spec(name: str, options: dict[str, str]) -> str:
    return name + "".join(f":{key}={options[key]}" for key in sorted(options))


def _takes(name: str, fixed: dict[str, str], key: str, value: float) -> bool:
    """Whether the method takes `key=value` (its own checks decide, as they would in eval)."""
    from ripplekv.methods import make_method

    try:
        make_method(_spec(name, {**fixed, key: f"{value:g}"}))
    except UserError:
        return False
    return True


def parse_grid(text: str) -> TuneGrid:
    """`cake:tau1=0.5,1,2:tau2=0.5,1,2` -> a TuneGrid; every starting point must be a method `eval` accepts."""
    from ripplekv.methods import PRESETS, make_method, parse_spec

    name, options = parse_spec(text)
    if name not in PRESETS:
        raise UserError(f"tune grid {text!r}: unknown method {name!r}; see `ripplekv methods`")
    fixed = {k: v for k, v in options.items() if "," not in v}
    axes = []
    for key, value in options.items():
        if "," not in value:
            continue
        try:
            values = tuple(float(part) for part in value.split(",") if part.strip())
        except ValueError:
            raise UserError(f"tune grid {text!r}: {key} must list numbers separated by commas, got {value!r}") from None
        axes.append(Axis(key, values, valid=lambda v, key=key: _takes(name, fixed, key, v)))
    if not axes:
        raise UserError(f"tune grid {text!r} lists no values to choose among; write e.g. cake:tau1=0.5,1,2")
    grid = TuneGrid(name, tuple(sorted(fixed.items())), tuple(axes), text)
    search = GridSearch(list(grid.axes))
    for point in search.pending:  # a bad option or value is one line before any model work
        make_method(grid.spec(point))
    return grid


@torch.inference_mode()
def calibration_fidelity(model, prompts, methods, budget: int, progress=None, log: UnitLog | None = None) -> pd.DataFrame:
    """Per prompt and method (`index`: its position in `methods`): teacher-forced KL(full || method) and agreement
    along the full cache's greedy answer.

    Each prompt is prefilled once (recording what every method needs) and all methods are scored together. With a
    `UnitLog`, prompts already in it are skipped and each finished prompt's rows are logged, so a rerun resumes."""
    from ripplekv.engine.decode import full_reference, measure_fidelity, stop_tokens
    from ripplekv.engine.prefill import Requirements, prefill_for

    rows = []
    needs = Requirements.of_all(methods)
    stop = stop_tokens(model)
    for index, prompt in enumerate(prompts):
        if log is not None and prompt.sample_id in log.done:
            rows.extend(log.done[prompt.sample_id])
            continue
        state = prefill_for(model, prompt.context + prompt.probe, needs, reserve=SWEEP_ANSWER_TOKENS)
        reference = full_reference(model, state, SWEEP_ANSWER_TOKENS, stop)
        scores = measure_fidelity(model, state, [m.compress(state, budget) for m in methods], reference, len(methods))
        done = [{"sample_id": prompt.sample_id, "index": i, "method": m.label, "kl": float(s.kl),
                 "agreement": float(s.agreement)} for i, (m, s) in enumerate(zip(methods, scores))]
        rows.extend(done)
        if log is not None:
            log.append(prompt.sample_id, done)
        if progress is not None:
            progress(index)
    return pd.DataFrame(rows, columns=["sample_id", "index", "method", "kl", "agreement"])


def output_paths(out: Path) -> dict[str, Path]:
    return {"json": out, "csv": out.with_suffix(".csv")}


@dataclass(frozen=True)
class GridSettings:
    """How a calibration grid is scored: at `budget`, a pick at an edge extending it at most `max_extensions` times."""

    budget: int = 128
    max_extensions: int = 3


def run_tune(grids: list[TuneGrid], out: Path, model: ModelChoice, calibration: Calibration, scoring: GridSettings,
             console, bar=None, announce=None) -> list[Path]:
    """Choose every grid's knobs on `calibration`'s prompts, rounds scored together; write OUT.json / .csv."""
    from contextlib import nullcontext

    from ripplekv.engine.models import resolve_model
    from ripplekv.methods import make_method
    from ripplekv.tasks.calibration import calibration_hash

    calibration.check()
    budget, max_extensions = scoring.budget, scoring.max_extensions
    if len({grid.base for grid in grids}) < len(grids):
        raise UserError("two tune grids are for the same method; give each method one grid")
    paths = output_paths(Path(out))
    source = resolve_model(model.spec)
    for path in paths.values():
        check_output(path, inputs=[source.location] if source.kind == "gguf" else [])
    if announce is not None:
        announce()
    loaded, tokenizer, _ = model.load()
    prompts = calibration.prompts(tokenizer)
    searches = [GridSearch(list(grid.axes), max_extensions) for grid in grids]
    round_index = 0
    while any(search.pending for search in searches):
        todo = [(search, point, grid.spec(point)) for grid, search in zip(grids, searches) for point in search.pending]
        log = UnitLog(paths["json"].with_name(f".{paths['json'].stem}.{round_index}.jsonl"),
                      {"model": source.location, "methods": [spec for _, _, spec in todo], "budget": budget,
                       "calibration_hash": calibration_hash(prompts)}, restart=True)
        context, advance = bar(len(prompts), len(log.done)) if bar else (nullcontext(), None)
        with context:
            per_sample = calibration_fidelity(loaded, prompts, [make_method(spec) for _, _, spec in todo], budget,
                                              progress=advance, log=log)
        means = per_sample.groupby("index").agg(kl=("kl", "mean"), agreement=("agreement", "mean"), n=("kl", "size"))
        for search in searches:
            rows = [{**point, **means.loc[i].to_dict()} for i, (owner, point, _) in enumerate(todo) if owner is search]
            if rows:
                search.add(pd.DataFrame(rows))
        round_index += 1
    return _write(grids, searches, paths, budget, calibration, prompts, console, round_index)


def _write(grids, searches, paths, budget, calibration, prompts, console, rounds) -> list[Path]:
    tables, report = [], {}
    for grid, search in zip(grids, searches):
        result = search.result()
        spec = grid.spec(result.pick)
        table = result.table.assign(method=grid.base, spec=[grid.spec(row) for row in
                                                            result.table[[a.name for a in grid.axes]].to_dict("records")])
        tables.append(table.assign(chosen=table["spec"] == spec))
        report[grid.base] = {"spec": spec, "grid": grid.text, "pick": result.pick, "axes": result.axes,
                             "extensions": result.extensions, "at_edge": result.at_edge, "notes": result.notes,
                             "summary": grid_summary(result)}
        console.print(f"{grid.base}: {grid_summary(result)} -> {spec}", soft_wrap=True)
    front = ["method", "spec"]
    table = pd.concat(tables, ignore_index=True)
    write_csv(paths["csv"], table[front + [c for c in table.columns if c not in front]], float_format="%.8g")
    write_json(paths["json"], {"budget": budget, "objective": "teacher-forced KL to the full cache (mean over prompts)",
                               **calibration.record(), "calibration_ids": [p.sample_id for p in prompts],
                               "tuned": {base: entry["spec"] for base, entry in report.items()}, "methods": report})
    for index in range(rounds):
        paths["json"].with_name(f".{paths['json'].stem}.{index}.jsonl").unlink(missing_ok=True)
    return [paths["json"], paths["csv"]]


def apply_tuned(methods: str, tuned: dict[str, str]) -> str:
    """A --methods list with every entry that names a tuned method (its spec without the tuned knobs) replaced by
    the tuned spec; other entries, and entries that set a tuned knob themselves, are kept as written."""
    from ripplekv.methods import parse_spec

    wanted = {tuple(sorted(parse_spec(base)[1].items())) + (parse_spec(base)[0],): spec for base, spec in tuned.items()}
    out = []
    for entry in (part.strip() for part in methods.split(",") if part.strip()):
        name, options = parse_spec(entry)
        out.append(wanted.get(tuple(sorted(options.items())) + (name,), entry))
    return ",".join(out)


def read_tuned(path: str | Path) -> dict[str, str]:
    """The `tuned` map of a tune.json (base spec -> tuned spec)."""
    try:
        return dict(json.loads(Path(path).read_text(encoding="utf-8"))["tuned"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a tune result ({err}); run `ripplekv tune` first") from None
