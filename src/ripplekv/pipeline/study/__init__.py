"""`make study`'s pipeline: its config (config), what it runs (plan) and the run that ties them (run), on the
generic staged runner (pipeline.staged)."""

from ripplekv.pipeline.study.run import study

__all__ = ["study"]
