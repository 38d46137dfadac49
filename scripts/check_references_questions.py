"""The question-agnostic multi-question protocol against kvpress's own pipeline with `questions=[...]`.

kvpress's `KVPressTextGenerationPipeline` prefills a context once under a press (compressed once, no question in
it), then answers each question greedily from that one cache, cutting each answer back off before the next. Here:
- our side (the project's venv): a few multi-question offline samples laid out as kvpress lays them out (the
  context in the chat template's user turn, each question followed by the template's closing), saved as token
  ids; the context prefilled once, every method x budget compressed once and every question answered through it by
  `engine.questions` (what `eval --protocol multi-question` runs), with the spec that reproduces each press's
  selection (`check_references.PAIRS`);
- `--worker` (the reference venv: kvpress 0.5.5, transformers 5.2.0): the same ids through the pipeline's own
  `_forward` (its prefill under the press, its greedy decoding, its answer removal), each press at the
  compression ratio that keeps B entries per head.
Per method: the share of (prompt, question, budget) answers that are the same text, with our tie order (among
entries whose scores tie at the cut, the lowest-indexed is kept) and again with kvpress's (`torch.topk`'s choice,
our side run a second time), and the last line `multi-question parity: N/M methods >= 0.99` (either order).

Run: `PYTHONPATH=src .venv/bin/python scripts/check_references_questions.py --venv /work/refvenv [--prompts 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from check_references_worker import KERNEL, WINDOW, ratio
from reference_venv import check_venv_path, default_venv, ensure_venv, one_line

MAX_NEW_TOKENS = 32
# our spec -> the kvpress press that makes the same selection (check_references.PAIRS, the scorer presses)
PRESSES = {
    f"snapkv:kernel={KERNEL}:pooling=avg": "snapkv",
    "streamingllm": "streamingllm",
    "tova": "tova",
    "knorm": "knorm",
    "expected-attention:window=0": "expected",
    "keydiff:window=0": "keydiff",
    f"criticalkv:kernel={KERNEL}:pooling=avg": "criticalkv",
}


def kvpress_layout(tokenizer, context: str, questions: list[str]) -> tuple[list[int], list[list[int]]]:
    """(context ids, question ids) as kvpress's pipeline builds them: the chat template around the context with a
    separator where the context ends; what follows the separator closes every question."""
    separator = "#" * (len(context) + 10)
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                         add_generation_prompt=True, tokenize=False)
    before, suffix = text.split(separator)
    ids = tokenizer.encode(before, add_special_tokens=False)
    return ids, [tokenizer.encode(question + suffix, add_special_tokens=False) for question in questions]


def our_side(args, out: Path) -> dict:
    """Prompts' ids (prompts.json) and our answers {spec: {budget: [[answer per question] per prompt]}}."""
    from ripplekv.engine.decode import stop_tokens
    from ripplekv.engine.models import load_model
    from ripplekv.engine.prefill import Requirements, prefill_for
    from ripplekv.engine.questions import decode_questions, question_references
    from ripplekv.engine.schedule import Decoding, SampleMemory, Variant
    from ripplekv.methods import make_method
    from ripplekv.tasks import get_tasks, load_samples

    model, tokenizer, _ = load_model(None, device="cpu", dtype="float32")
    budgets = [int(b) for b in args.budgets.split(",")]
    variants = [Variant(spec, budget, make_method(spec)) for spec in PRESSES for budget in budgets]
    needs = Requirements.of_all(variant.method for variant in variants)
    stops = stop_tokens(model, tokenizer)
    prompts, answers = [], {spec: {budget: [] for budget in budgets} for spec in PRESSES}
    records = [record for task in get_tasks("offline", ["niah_multiquestion", "squad_multiquestion"])
               for record in load_samples(task, tokenizer, limit=args.prompts, target_tokens=args.target_tokens)]
    for record in records:
        context, questions = kvpress_layout(tokenizer, record["context"],
                                            [f"\n\nQuestion: {one['input']}\nAnswer briefly." for one in record["questions"]])
        prompts.append({"context": context, "questions": questions})
        state = prefill_for(model, context, needs)
        references = question_references(model, state, questions, MAX_NEW_TOKENS, stops)
        decoded = decode_questions(model, state, references, questions, variants, Decoding(MAX_NEW_TOKENS),
                                   SampleMemory(model), stops)
        for index, variant in enumerate(variants):
            answers[variant.label][variant.budget].append(
                [tokenizer.decode(asked[index].tokens, skip_special_tokens=True) for asked in decoded])
        print(f"ours: {record['_id']} ({state.length} tokens, {len(questions)} questions) done", file=sys.stderr)
    (out / "prompts.json").write_text(json.dumps(prompts))
    return answers


def worker(args) -> None:
    """kvpress's pipeline on the saved ids: {press: {budget: [[answer per question] per prompt]}}."""
    import torch
    from check_references_worker import build_presses
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    out = Path(args.out)
    eager, _ = build_presses(model, None, out)
    prompts = json.loads((out / "prompts.json").read_text())
    budgets = [int(b) for b in args.budgets.split(",")]
    found = {name: {budget: [] for budget in budgets} for name in PRESSES.values()}
    for prompt in prompts:
        context = torch.tensor([prompt["context"]])
        questions = [torch.tensor([ids]) for ids in prompt["questions"]]
        for name in PRESSES.values():
            for budget in budgets:
                press = eager[name]
                press.compression_ratio = ratio(name, budget, context.shape[1], 0)
                with torch.no_grad():
                    answers = pipe._forward({"context_ids": context, "questions_ids": questions},
                                            max_new_tokens=MAX_NEW_TOKENS, press=press)
                found[name][budget].append(answers)
        print(f"reference: a prompt of {context.shape[1]} tokens done", file=sys.stderr)
    (out / "reference_answers.json").write_text(json.dumps(found))


def kvpress_ties() -> None:
    """Make every selection of this process keep, among entries tied at the cut, those `torch.topk` returns (as
    kvpress's presses pick) instead of the lowest-indexed (`methods.core.selection`): the rebinding reaches each
    ripplekv module that imported the two functions by name."""
    import torch

    from ripplekv.methods.core import selection

    def topk_indices(scores, count):
        return torch.topk(scores, min(count, scores.shape[-1]), dim=-1).indices

    def topk_mask(scores, count):
        mask = torch.zeros_like(scores, dtype=torch.bool)
        return mask.scatter_(-1, topk_indices(scores, count), True) if count > 0 else mask

    replaced = [(selection.top_indices, topk_indices), (selection.top_mask, topk_mask)]
    for name, module in list(sys.modules.items()):
        if name.startswith("ripplekv"):
            for attribute, value in list(vars(module).items()):
                for original, replacement in replaced:
                    if value is original:
                        setattr(module, attribute, replacement)


def compare(ours: dict, theirs: dict, tied: dict) -> list[tuple[str, bool, str]]:
    """Per method: the share of identical answers with our tie order and with kvpress's (`kvpress_ties`); a
    method agrees when either reaches 0.99 (as `make check-references` counts kept sets up to tied scores)."""
    lines = []
    for spec, name in PRESSES.items():
        shares = []
        for answers in (ours, tied):
            pairs = [(a, b) for budget, per_prompt in answers[spec].items()
                     for mine, refs in zip(per_prompt, theirs[name][str(budget)]) for a, b in zip(mine, refs)]
            shares.append(np.mean([a.strip() == b.strip() for a, b in pairs]))
        lines.append((spec, max(shares) >= 0.99, f"{spec:<34} vs kvpress {name:<12} identical answers "
                      f"{shares[0]:.4f} of {len(pairs)} (prompt, question, budget); with kvpress's tie order "
                      f"{shares[1]:.4f}"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=1, help="samples per multi-question task")
    parser.add_argument("--budgets", default="64,256")
    parser.add_argument("--target-tokens", type=int, default=2000)
    parser.add_argument("--venv", default=default_venv())
    parser.add_argument("--out", default="runs/check-references-questions")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    one_line(lambda: check_and_compare(args))


def check_and_compare(args) -> None:
    from ripplekv.errors import UserError
    from ripplekv.pipeline.eval_plan import parse_budgets
    from ripplekv.runs.safeio import check_output

    budgets = list(parse_budgets([args.budgets]))
    if any(b <= WINDOW for b in budgets) or args.prompts < 1:
        raise UserError(f"--budgets must exceed the window ({WINDOW}) and --prompts be at least 1")
    args.budgets = ",".join(map(str, budgets))
    check_venv_path(args.venv)
    out = check_output(args.out, kind="dir")
    python = ensure_venv(Path(args.venv))
    out.mkdir(parents=True, exist_ok=True)
    from ripplekv.engine.models import _source_and_location, load_tokenizer

    _, model_dir = _source_and_location(None)
    tokenizer_dir = out / "tokenizer"
    load_tokenizer(None).save_pretrained(tokenizer_dir)
    ours = our_side(args, out)
    kvpress_ties()
    tied = our_side(args, out)  # the same, entries tied at the cut kept as torch.topk keeps them
    subprocess.run([str(python), os.path.abspath(__file__), "--worker", "--model-dir", model_dir, "--tokenizer-dir",
                    str(tokenizer_dir), "--out", str(out), "--budgets", args.budgets], check=True,
                   env={**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"})
    theirs = json.loads((out / "reference_answers.json").read_text())
    lines = compare(ours, theirs, tied)
    (out / "ours_answers.json").write_text(json.dumps(ours))
    (out / "ours_answers_kvpress_ties.json").write_text(json.dumps(tied))
    for _, _, text in lines:
        print(text)
    print(f"multi-question parity: {sum(ok for _, ok, _ in lines)}/{len(lines)} methods >= 0.99 "
          f"(B = {args.budgets}, {MAX_NEW_TOKENS} new tokens)")
    sys.exit(0 if all(ok for _, ok, _ in lines) else 1)


if __name__ == "__main__":
    main()
