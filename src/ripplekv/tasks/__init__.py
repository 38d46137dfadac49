"""Evaluation data: the task registry, real LongBench loading and the bundled offline suite."""

from ripplekv.tasks.prompts import build_prompt_ids
from ripplekv.tasks.registry import Task, default_suite, get_tasks, list_suites, load_samples

__all__ = ["Task", "build_prompt_ids", "default_suite", "get_tasks", "list_suites", "load_samples"]
