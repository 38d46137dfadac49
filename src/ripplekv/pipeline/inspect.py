"""`ripplekv inspect`'s work: which entries a method keeps for one prompt, saved as data and drawn.

The CLI checks the output folder and takes its lock first; this loads the model, prefills once for what
the method declares, compresses, and writes `kept.npz` (atomically) and `kept.png`. Under
`decode_budget="total"` it then decodes the method's own greedy answer with eviction (`engine.evict`) and
saves what each head holds at the end: prompt positions still held, and decoded ones (positions >= n).
"""

from __future__ import annotations

from pathlib import Path

from ripplekv.pipeline.model_choice import ModelChoice
from ripplekv.pipeline.samples import PromptChoice


def inspect_into(folder: Path, chosen, budget: int, model: ModelChoice, prompt: PromptChoice, *,
                 decode_budget: str = "prompt", compress_every: int = 8) -> str:
    """Write kept.npz and kept.png for `chosen` at `budget` on the chosen prompt; returns the title."""
    import io
    import json

    import numpy as np

    from ripplekv.analysis.kept import answer_positions, kept_arrays, plot_kept
    from ripplekv.engine.models import load_tokenizer
    from ripplekv.engine.prefill import Requirements, prefill_for
    from ripplekv.engine.recorders import SampleContext
    from ripplekv.runs.safeio import atomic_write

    tokenizer = load_tokenizer(model.spec)
    prompt = prompt.build(tokenizer)
    ids, question, answers, label = prompt.ids, prompt.question_start, prompt.answers, prompt.label
    loaded, _, source = model.load()
    inside = question if 0 < question < len(ids) else None  # the task's context/question split, if any
    state = prefill_for(loaded, ids, Requirements.of_all([chosen]), context=SampleContext(tokenizer, question_at=inside))
    built = chosen.compress(state, budget)
    notes = chosen.build_notes(state, budget) if hasattr(chosen, "build_notes") else None  # e.g. GraceKV's split kinds
    decoded = None
    if decode_budget == "total":
        decoded, built = decode_held(loaded, tokenizer, state, chosen, budget, built, prompt.task, compress_every)
    arrays = kept_arrays(built)
    needles = answer_positions(ids, tokenizer, answers, question)
    meta = {"method": chosen.label, "spec": chosen.describe(), "budget": budget, "prompt_tokens": state.length,
            "question_start": question, "answer_positions": needles, "sample": label, "model": source.label}
    if notes:
        meta["build"] = notes
    if decoded is not None:  # absent under prompt budgets: those files stay as before the option
        meta.update(decode_budget=decode_budget, compress_every=compress_every, decoded_tokens=decoded)
    buffer = io.BytesIO()  # np.savez would add .npz to a temporary name: write the bytes ourselves
    np.savez_compressed(buffer, **arrays, question_start=question, answer_positions=np.asarray(needles, dtype=np.int64),
                        meta=json.dumps(meta))
    atomic_write(folder / "kept.npz", lambda tmp: tmp.write_bytes(buffer.getvalue()))
    kept_needles = int(sum(int((arrays["spans"][..., 0] <= p)[(arrays["spans"][..., 1] > p)].sum()) for p in needles))
    slots = len(needles) * arrays["counts"].size
    title = (f"{source.label}: {chosen.label} at B={budget} on {label} ({state.length} tokens, "
             f"{int(arrays['counts'].sum())} entries); answer tokens kept in {kept_needles} of {slots} (token, layer, head) slots")
    if notes:
        title += "; " + ", ".join(f"{key} {value}" for key, value in notes.items())
    if decoded is not None:
        title += f"; held after decoding {decoded} tokens under a total budget (decoded entries not drawn)"
    plot_kept(folder / "kept.png", arrays, state.length, question, needles, title)
    return title


# Answer length when the prompt is a file (a suite sample decodes its task's own max_new_tokens).
FILE_ANSWER_TOKENS = 128


def decode_held(model, tokenizer, state, chosen, budget: int, built, task, every: int):
    """(tokens fed, entries each head holds after the method's own greedy answer under a total budget)."""
    from ripplekv.engine.decode import greedy_decode, stop_tokens
    from ripplekv.engine.evict import attach, capacities, held_entries

    policy = chosen.decode_policy(every)
    caps = [capacities(chosen.budgets(state, budget), budget)]
    stops = stop_tokens(model, tokenizer, bool(task is not None and task.stop_at_newline))
    steps = task.max_new_tokens if task is not None else FILE_ANSWER_TOKENS
    caches = []
    tokens = greedy_decode(model, state, [built], steps, stops,
                           prepare=lambda cache: (attach(cache, state, [built], policy, caps), caches.append(cache)))[0]
    if len(tokens) == 1:  # the first token (from the prefill) ends the answer: nothing was fed
        return 0, built
    return len(tokens) - 1, [held_entries(layer) for layer in caches[0].layers]

