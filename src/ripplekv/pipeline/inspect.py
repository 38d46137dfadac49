"""`ripplekv inspect`'s work: which entries a method keeps for one prompt, saved as data and drawn.

The CLI checks the output folder and takes its lock first; this loads the model, prefills once for what
the method declares, compresses, and writes `kept.npz` (atomically) and `kept.png`.
"""

from __future__ import annotations

from pathlib import Path


def inspect_into(folder: Path, chosen, budget: int, model, *, task=None, index: int = 0, prompt_file=None,
                 suite: str = "offline", data_dir=None, target_tokens: int = 3500, max_length: int = 7500, device: str = "auto",
                 dtype: str = "auto") -> str:
    """Write kept.npz and kept.png for `chosen` at `budget` on a task sample or a prompt file; returns the title."""
    import io
    import json

    import numpy as np

    from ripplekv.analysis.kept import answer_positions, kept_arrays, plot_kept
    from ripplekv.engine.models import load_model, load_tokenizer
    from ripplekv.engine.prefill import Requirements, prefill_for
    from ripplekv.pipeline.samples import file_prompt, sample_prompt
    from ripplekv.runs.safeio import atomic_write

    tokenizer = load_tokenizer(model)
    if prompt_file is not None:
        prompt = file_prompt(tokenizer, prompt_file)
    else:
        prompt = sample_prompt(tokenizer, task, index, suite=suite, data_dir=data_dir, target_tokens=target_tokens,
                               max_length=max_length)
    ids, question, answers, label = prompt.ids, prompt.question_start, prompt.answers, prompt.label
    loaded, _, source = load_model(model, device=device, dtype=dtype)
    state = prefill_for(loaded, ids, Requirements.of_all([chosen]))
    built = chosen.compress(state, budget)
    arrays = kept_arrays(built)
    needles = answer_positions(ids, tokenizer, answers, question)
    meta = {"method": chosen.label, "spec": chosen.describe(), "budget": budget, "prompt_tokens": state.length,
            "question_start": question, "answer_positions": needles, "sample": label, "model": source.label}
    buffer = io.BytesIO()  # np.savez would add .npz to a temporary name: write the bytes ourselves
    np.savez_compressed(buffer, **arrays, question_start=question, answer_positions=np.asarray(needles, dtype=np.int64),
                        meta=json.dumps(meta))
    atomic_write(folder / "kept.npz", lambda tmp: tmp.write_bytes(buffer.getvalue()))
    kept_needles = int(sum(int((arrays["spans"][..., 0] <= p)[(arrays["spans"][..., 1] > p)].sum()) for p in needles))
    slots = len(needles) * arrays["counts"].size
    title = (f"{source.label}: {chosen.label} at B={budget} on {label} ({state.length} tokens, "
             f"{int(arrays['counts'].sum())} entries); answer tokens kept in {kept_needles} of {slots} (token, layer, head) slots")
    plot_kept(folder / "kept.png", arrays, state.length, question, needles, title)
    return title
