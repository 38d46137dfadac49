"""Evaluation data: the task registry, real LongBench loading and the bundled offline suite."""

from ripplekv.data.prompts import build_prompt_ids
from ripplekv.data.tasks import Task, default_suite, get_tasks, list_suites, load_samples

__all__ = ["Task", "build_prompt_ids", "default_suite", "get_tasks", "list_suites", "load_samples"]
