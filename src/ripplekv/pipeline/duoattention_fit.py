"""DuoAttention's gates fitted on calibration prompts (never evaluated ones), resumable.

The objective is the paper's (`methods.duoattention.objective`): on synthetic needle prompts whose answer is
appended (the offline suite's `niah` and `niah_multikey` calibration split by default, disjoint from every
evaluated sample), the gates are trained so the mixed model's last hidden states on the answer match the full
model's, plus an L1 penalty; the model is frozen. As the paper's training: gates start at 1, are clamped to
[0, 1] before each step, AdamW (lr 0.02, no weight decay) with a linear warm-up and decay over a fifth of the
steps each (at least a tenth of the rate). One prompt per step, in turn.

After every step the gates, the optimiser's state, the step count and the loss history go to
`OUT/checkpoint.pt` (atomically), and the gates so far to `OUT/duoattention-gates.json` with their provenance
(steps done, final loss, seconds), so a killed run resumes where it stopped and its file says how far it got;
other settings in the same folder are refused.
"""

from __future__ import annotations

import io
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ripplekv.engine.config_shape import ConfigShape
from ripplekv.errors import UserError
from ripplekv.methods.duoattention.gates import gates_text
from ripplekv.methods.duoattention.objective import gate_loss, last_hidden
from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.runs.safeio import atomic_write, exclusive, other_files
from ripplekv.tasks.calibration import Calibration, calibration_hash

CHECKPOINT, GATES = "checkpoint.pt", "duoattention-gates.json"
DEFAULT_TASKS = ("niah", "niah_multikey")


@dataclass(frozen=True)
class GateSettings:
    """What determines the fitted gates beside their calibration prompts (the checkpoint's and the file's record)."""

    steps: int = 40
    sinks: int = 16
    recent: int = 64
    l1: float = 0.05  # the published patterns' reg=0.05
    lr: float = 0.02  # the published patterns' lr=0.02

    def check(self) -> None:
        if self.steps < 1 or self.sinks < 0 or self.recent < 1:
            raise UserError(f"--steps and --recent must be at least 1 and --sinks at least 0, got {self.steps}, "
                            f"{self.recent} and {self.sinks}")
        if not (self.l1 >= 0 and self.lr > 0):
            raise UserError(f"--l1 must be at least 0 and --lr above 0, got {self.l1} and {self.lr}")


def rate(step: int, steps: int) -> float:
    """The learning-rate factor at `step` of `steps`: linear warm-up and decay over a fifth each, at least 0.1."""
    ramp = max(steps // 5, 1)
    return min(1.0, max((step + 1) / ramp, 0.1), max((steps - step) / ramp, 0.1))


def answer_prompts(calibration: Calibration, tokenizer) -> list[tuple[str, list[int], int]]:
    """(sample id, prompt + answer ids, answer length) per calibration prompt; the answer is the first gold one."""
    found = []
    for prompt in calibration.prompts(tokenizer):
        answer = len(tokenizer(prompt.answers[0], add_special_tokens=False).input_ids)
        ids = prompt.context + prompt.probe
        if answer < 1 or answer >= len(ids):
            raise UserError(f"calibration sample {prompt.sample_id} has no answer tokens to distil on")
        found.append((prompt.sample_id, ids, answer))
    return found


def fit_gates(out: Path, model: ModelChoice, settings: GateSettings, calibration: Calibration,
              bar=None, announce=None) -> tuple[Path, dict]:
    """Fit (or resume) the gates into `out`; (gates file, provenance). `bar(total, done)` gives (context manager,
    advance) for a progress bar over the steps; `announce()` once every input is checked."""
    from ripplekv.engine.models import load_tokenizer, resolve_model

    settings.check()
    calibration.check()
    out = Path(out)
    foreign = other_files(out, [CHECKPOINT, GATES])
    if foreign:
        raise UserError(f"--out {out} holds other files ({', '.join(foreign[:3])}); pass a new or empty directory")
    model = model.resolved()
    prompts = answer_prompts(calibration, load_tokenizer(model.spec))
    header = {"model": resolve_model(model.spec).label, **asdict(settings), "calib_samples": calibration.samples,
              "target_tokens": calibration.target_tokens, **calibration.record(),
              "calibration_ids": [p[0] for p in prompts], "calibration_hash": _hash(calibration, prompts),
              "prompt_tokens": [len(p[1]) for p in prompts], "answer_tokens": [p[2] for p in prompts]}
    if announce is not None:
        announce()
    with exclusive(out, "duoattention fit"):
        state = _resume(out / CHECKPOINT, header)
        loaded, _, _ = model.load()
        loaded.eval()
        for parameter in loaded.parameters():
            parameter.requires_grad_(False)
        counts = ConfigShape.of(loaded.config)
        layers, heads = counts.layers, counts.kv_heads
        gates = torch.nn.Parameter(state["gates"] if state else torch.ones(layers, heads, dtype=torch.float32))
        optimizer = torch.optim.AdamW([gates], lr=settings.lr, weight_decay=0.0)
        if state:
            optimizer.load_state_dict(state["optimizer"])
        history = state["history"] if state else []
        context, advance = bar(settings.steps, len(history)) if bar else (nullcontext(), None)
        full_cache: dict[int, torch.Tensor] = {}
        with context:
            for step in range(len(history), settings.steps):
                begun = time.perf_counter()
                index = step % len(prompts)
                _, ids, answer = prompts[index]
                tokens = torch.as_tensor(ids, device=loaded.device)
                if index not in full_cache:
                    with torch.no_grad():
                        full_cache[index] = last_hidden(loaded, tokens)
                with torch.no_grad():
                    gates.clamp_(0, 1)
                for group in optimizer.param_groups:
                    group["lr"] = settings.lr * rate(step, settings.steps)
                loss, distill = gate_loss(loaded, tokens, answer, gates.to(loaded.device), settings.sinks,
                                          settings.recent, settings.l1, full_cache[index])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                history.append({"step": step + 1, "prompt": prompts[index][0], "loss": round(loss.item(), 6),
                                "distill": round(distill.item(), 6), "seconds": round(time.perf_counter() - begun, 2)})
                path, provenance = _save(out, header, gates, optimizer, history, settings)
                if advance is not None:
                    advance(step)
        return _save(out, header, gates, optimizer, history, settings)


def _hash(calibration: Calibration, prompts) -> str:
    from types import SimpleNamespace

    return calibration_hash([SimpleNamespace(sample_id=sid, context=ids, probe=[]) for sid, ids, _ in prompts])


def _resume(path: Path, header: dict) -> dict | None:
    """The checkpoint's state when it was made with these settings; other settings are one line."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a foreign or torn file: never silently restarted over
        raise UserError(f"{path} is not a readable checkpoint ({str(err).splitlines()[0]}); delete it to start over") from None
    if state.get("header") != header:
        old = state.get("header") or {}
        differing = sorted(k for k in set(old) | set(header) if old.get(k) != header.get(k))
        raise UserError(f"{path.parent} holds a fit of other settings (differs in: {', '.join(differing)}); use a new "
                        "--out directory, or rerun with the same options to resume")
    return state


def _save(out: Path, header: dict, gates, optimizer, history: list, settings: GateSettings) -> tuple[Path, dict]:
    """The checkpoint and the gates file after a step (both atomic)."""
    clamped = gates.detach().float().clamp(0, 1).cpu()
    state = {"header": header, "gates": gates.detach().float().cpu().clone(), "optimizer": optimizer.state_dict(),
             "history": history}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    atomic_write(out / CHECKPOINT, lambda tmp: tmp.write_bytes(data))
    last = history[-1]
    provenance = {**header, "steps_done": len(history), "final_loss": last["loss"], "final_distill": last["distill"],
                  "seconds": round(sum(h["seconds"] for h in history), 1),
                  "objective": "mean over answer positions of the mean squared difference of the last hidden states "
                               "(mixed vs full attention) + l1 x mean |gate|",
                  "history": [{k: h[k] for k in ("step", "loss", "distill")} for h in history]}
    text = gates_text(clamped.tolist(), settings.sinks, settings.recent, provenance)
    atomic_write(out / GATES, lambda tmp: tmp.write_text(text))
    return out / GATES, provenance
