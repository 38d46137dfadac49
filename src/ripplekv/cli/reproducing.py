"""`ripplekv reproduce CONFIG` and `ripplekv study CONFIG`: the pipelines of `make reproduce` and `make study`, each
from one config (configs/NAME.toml)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def reproduce_command(
    config: Annotated[Path, typer.Argument(help="The pipeline's config, e.g. configs/quick.toml (each setting is "
                                                "explained in configs/reproduce.toml).")],
    check_only: Annotated[bool, typer.Option("--check-only", help="Run the pre-flight alone: every setting, task, "
                                             "method and budget checked against the model's config, nothing built.")]
    = False,
    page_only: Annotated[bool, typer.Option("--page-only", help="Rewrite OUT/README.md (the results page) from the "
                                            "finished run in OUT; no stage runs.")] = False,
    status: Annotated[bool, typer.Option("--status", help="Say where the run in progress stands (stages done, "
                                         "samples done per eval, time left at its pace so far); nothing runs.")]
    = False,
) -> None:
    """Run the pipeline: calibration stages per draw, evals, the results page (OUT/README.md).

    Builds in runs/.staging/NAME and replaces OUT only when every stage succeeded (the earlier OUT moves to
    runs/previous-NAME-DATE). Rerun the same command to resume: finished stages are skipped, evals resume.
    Run it from the repository's root (the fitter scripts and runs/ are found from there).
    """
    from ripplekv.errors import UserError
    from ripplekv.pipeline.reproduce import reproduce
    from ripplekv.pipeline.staged import StageFailed

    try:
        if status:
            from ripplekv.pipeline.reproduce.config import load_config
            from ripplekv.pipeline.run_status import staged_status

            print("\n".join(staged_status(load_config(str(config)).out)))
            return
        reproduce(str(config), check_only=check_only, page_only=page_only)
    except UserError as err:
        raise UserError(f"{config}: {err}") from None
    except StageFailed as failed:
        print(f"== {failed.stage} failed (exit {failed.code}); finished stages are kept: rerun the same command to "
              "resume", flush=True)
        sys.exit(failed.code)


def study_command(
    config: Annotated[Path, typer.Argument(help="The study's config, e.g. configs/study.toml (each setting explained "
                                                "there).")] = Path("configs/study.toml"),
    check_only: Annotated[bool, typer.Option("--check-only", help="Read and check the config alone; nothing runs.")]
    = False,
    page_only: Annotated[bool, typer.Option("--page-only", help="Rewrite OUT/README.md from the finished study in "
                                            "OUT; no stage runs.")] = False,
    status: Annotated[bool, typer.Option("--status", help="Say where the run in progress stands (stages done, "
                                         "samples done per eval, time left at its pace so far); nothing runs.")]
    = False,
) -> None:
    """A controlled, powered study: screen -> calibration per draw -> pilot and n -> factorial eval -> draws ->
    second model -> OUT/README.md (hours on 2 cores).

    Builds in runs/.staging/NAME and replaces OUT only when every stage succeeded; rerun the same command to
    resume (finished stages are skipped, evals resume where they stopped).
    """
    from ripplekv.errors import UserError
    from ripplekv.pipeline.staged import StageFailed
    from ripplekv.pipeline.study import study

    try:
        if status:
            from ripplekv.pipeline.run_status import staged_status
            from ripplekv.pipeline.study.config import load_study_config

            print("\n".join(staged_status(load_study_config(str(config)).out)))
            return
        study(str(config), check_only=check_only, page_only=page_only)
    except UserError as err:
        raise UserError(f"{config}: {err}") from None
    except StageFailed as failed:
        print(f"== {failed.stage} failed (exit {failed.code}); finished stages are kept: rerun the same command to "
              "resume", flush=True)
        sys.exit(failed.code)
