"""What one calibration sample gives for each kind of profile (`ProfileSettings.kind`), and how the logged
values of every sample become the profile when a signal needs them all at once.

Each entry of `SAMPLE_MEASURES` is f(model, tokenizer, prompt, settings, index) -> an array that the profile
logs for the sample (fsynced, so an interrupted profile resumes); `FINISHERS` turns the stacked logs into
the per-seed values [samples, seeds, layers] and extra profile.json fields. A new signal is one entry in each.
"""

from __future__ import annotations

import numpy as np


def _kl_sample(model, tokenizer, prompt, settings, index: int) -> np.ndarray:
    """[seeds, L]: KL at the probe tokens with each layer perturbed (noise) or evicted (evict, --measure kl)."""
    from ripplekv.pipeline.layer_kl import profile_prompt

    return profile_prompt(model, prompt, settings, index)


def _task_drop_sample(model, tokenizer, prompt, settings, index: int) -> np.ndarray:
    """[1, 1 + L]: the full cache's score, then the drop with each layer pruned alone."""
    from ripplekv.pipeline.taskdrop import task_drop

    full, drops = task_drop(model, tokenizer, prompt, settings.evict_pruner(), settings.ratio(), settings.batch_size)
    return np.concatenate([[full], drops])[None]


def _infonce_sample(model, tokenizer, prompt, settings, index: int) -> np.ndarray:
    """[2, L, d]: the pooled layers of the prompt's two views (the InfoNCE needs every prompt: `FINISHERS`)."""
    from ripplekv.pipeline.representation import prompt_views

    return prompt_views(model, list(prompt.context) + list(prompt.probe), index)


# What one calibration sample gives, by `ProfileSettings.kind`: f(model, tokenizer, prompt, settings, index).
SAMPLE_MEASURES = {
    "noise": _kl_sample,
    "evict-kl": _kl_sample,
    "evict-task-drop": _task_drop_sample,
    "infonce": _infonce_sample,
}


def _finish_task_drop(values: np.ndarray) -> tuple[np.ndarray, dict]:
    return values[:, :, 1:], {"full_scores": values[:, 0, 0].tolist()}


def _finish_infonce(values: np.ndarray) -> tuple[np.ndarray, dict]:
    from ripplekv.pipeline.representation import TEMPERATURE, anchor_losses, mutual_information_bound

    losses = anchor_losses(values)
    bound = mutual_information_bound(losses.mean(0), len(losses))
    return losses[:, None, :], {"temperature": TEMPERATURE, "infonce_mi_bound": [float(b) for b in bound]}


# From every sample's logged value [samples, ...] to (per-seed values [samples, seeds, layers], extra profile.json
# fields); kinds not listed log that matrix already.
FINISHERS = {"evict-task-drop": _finish_task_drop, "infonce": _finish_infonce}
