"""`make reproduce`'s pipeline: a config (config), its pre-flight (checks), its stages (calibration, evals) and
the run that ties them (run), on the generic staged runner (pipeline.staged)."""

from ripplekv.pipeline.reproduce.run import reproduce

__all__ = ["reproduce"]
