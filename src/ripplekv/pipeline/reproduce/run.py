"""`ripplekv reproduce CONFIG`: profile -> allocate [-> DepthKV, CompressKV, route, per draw] [-> LU-KV's curves]
[-> tuned baselines] -> eval [-> the draws' eval, DepthKV's headline, comparisons, memory axis, context-only,
long answers, needle] -> the results page, from one config (configs/NAME.toml) on a `staged.StagedRun`.

Every stage runs the `ripplekv` command (or, until `ripplekv fit` lands, the fitter script) a user would type,
in a subprocess, so its outputs are those of the command; the small steps between them (the predictors table,
the tuned and the draws' method lists, the calibration spread) are this package's functions.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from ripplekv.errors import UserError
from ripplekv.pipeline.draws import write_spread
from ripplekv.pipeline.reproduce.calibration import calibration_stages, lukv_stage, tune_stage
from ripplekv.pipeline.reproduce.checks import check_config, stage_files
from ripplekv.pipeline.reproduce.config import ReproduceConfig, load_config
from ripplekv.pipeline.reproduce.evals import EvalSpec, declared_evals, draws_eval, fed_lists, multi_question_evals
from ripplekv.pipeline.staged import PROGRAM, StagedRun, ripplekv_command


def pooled(run: StagedRun, config: ReproduceConfig, name: str) -> str:
    """The profile folder NAME of every draw, comma-joined (the predictors pool them)."""
    return ",".join([run.path(name)] + [run.path("draws", f"d{d}", name) for d in range(1, config.draw_count)])


def write_predictors(drop: str, signals: list[str], out: str) -> None:
    """How well each signal ranks layers as DepthKV's measured drop does (analysis.predictors), into `out`."""
    from ripplekv.analysis.predictors import predictor_table
    from ripplekv.runs.safeio import check_output, write_csv

    check_output(out, inputs=[Path(p) for p in (drop, *signals)])
    table = predictor_table(drop, signals)
    write_csv(Path(out), table, float_format="%.6g")  # a missing folder is made; a failure is one line
    for row in table.itertuples():
        print(f"{row.signal}: Spearman rho with the task drop {row.spearman:.3f} "
              f"[{row.low:.3f}, {row.high:.3f}] ({row.samples_drop} samples{', paired' if row.paired else ''})")


def write_draws_table(run: StagedRun, config: ReproduceConfig, methods: str, route: str | None) -> str:
    """The further draws' variants of every calibrated method in `methods`, comma-joined, and OUT/draws.csv
    (which eval label is which draw; draw 0's lines are eval's own)."""
    from ripplekv.pipeline.draws import draw_variants
    from ripplekv.runs.safeio import write_csv

    extra, table = draw_variants(methods, run.out, config.draw_count,
                                 {"allocation": run.path("allocation.csv"), "route": route})
    write_csv(Path(run.path("draws.csv")), table)
    return ",".join(extra)


def calibrate(run: StagedRun, config: ReproduceConfig) -> None:
    """Every draw's calibration stages; a further draw's route is also copied to OUT/draws/dD/ROUTE-dD.csv."""
    for draw in range(config.draw_count):
        folder = run.out if draw == 0 else run.path("draws", f"d{draw}")
        for stage in calibration_stages(config, draw, folder):
            run.stage(stage.name, stage.marker, stage.command)
        if draw and config.route_calib_samples:
            shutil.copy(f"{folder}/route/ROUTE.csv", f"{folder}/ROUTE-d{draw}.csv")


def evaluated_methods(run: StagedRun, config: ReproduceConfig) -> tuple[str, str | None]:
    """(the main eval's --methods, the headline eval's) once the calibration stages ran: stage-fed methods get
    draw 0's files, LU-KV its curves, tuned baselines their tuned knobs; the predictors stage runs here too."""
    files = stage_files(config, run.out)
    if config.evict_calib_samples:
        signals = [pooled(run, config, name) for name in ("profile", "profile-evict-kl", "profile-infonce")]
        drop, out = pooled(run, config, "profile-evict"), run.path("predictors.csv")
        run.step("predictors", out, f"ripplekv.pipeline.reproduce.run.write_predictors {drop} {' '.join(signals)} --out {out}",
                 lambda: write_predictors(drop, signals, out))
    methods, headline = fed_lists(config, files)
    stage, methods = lukv_stage(config, run.out, methods)
    if stage:
        run.stage(stage.name, stage.marker, stage.command)
    stage = tune_stage(config, run.out)
    if stage:  # the METHODS entry naming a tuned method is evaluated as tuned
        from ripplekv.pipeline.tune import apply_tuned, read_tuned

        run.stage(stage.name, stage.marker, stage.command)
        methods = apply_tuned(methods, read_tuned(run.path("tune.json")))
    return methods, headline


def evaluate(run: StagedRun, config: ReproduceConfig, methods: str, headline: str | None) -> None:
    route = run.path("route", "ROUTE.csv") if config.route_calib_samples else None
    specs = declared_evals(config, run.out, methods, headline, route)
    run_eval(run, specs[0])
    if config.draw_count > 1:  # every calibrated method once more per draw d >= 1, on the same samples
        draw_methods = write_draws_table(run, config, methods, route)
        if draw_methods:
            run_eval(run, draws_eval(config, run.out, draw_methods))
            write_spread(Path(run.out))
    for spec in specs[1:]:
        run_eval(run, spec)


def run_eval(run: StagedRun, spec: EvalSpec) -> None:
    run.always(spec.name, spec.title, ripplekv_command(*spec.argv()))


def write_page(out: Path, config: ReproduceConfig, final: str) -> None:
    """OUT/README.md, then every run's web page and OUT/index.html linking them (`report --site`)."""
    from ripplekv.analysis.html_page import write_site
    from ripplekv.analysis.multi_question_page import write_multi_question_page
    from ripplekv.analysis.results_page import write_results_page
    from ripplekv.methods.core.catalog import method_notes
    from ripplekv.tasks import get_tasks

    tasks = get_tasks("offline", list(config.long_tasks)) if config.long_tasks else []
    # before the results page, which links it; its commands as the run records them (the final folder's paths)
    write_multi_question_page(out, [shlex.join((PROGRAM, *spec.argv())) for spec in multi_question_evals(config, final)])
    write_results_page(out, config.path, final, {task.name: task.max_new_tokens for task in tasks})
    write_site(out, notes=method_notes())


def reproduce(config_path: str, check_only: bool = False, page_only: bool = False) -> None:
    """Run the pipeline of `config_path` (see the module docstring); `check_only`: the pre-flight alone;
    `page_only`: rewrite the finished output's README.md from what it holds (no stage runs)."""
    config = load_config(config_path)
    if page_only:
        final = Path(config.out)
        if not (final / "profile" / "profile.json").is_file():
            raise UserError(f"{config.out} holds no finished run of {config_path}: run `ripplekv reproduce "
                            f"{config_path}` first")
        write_page(final, config, config.out)
        print(f"== {config.out}/README.md written")
        return
    check_config(config)
    print(f"== pre-flight: {config_path} checked (tasks, methods, budgets, stages)", flush=True)
    if check_only:
        return
    run = StagedRun(config.out)
    run.begin()
    calibrate(run, config)
    methods, headline = evaluated_methods(run, config)
    evaluate(run, config, methods, headline)
    run.carry(config.carry or ())
    write_page(Path(run.out), config, run.final)
    run.finish()
