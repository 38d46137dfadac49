"""One eval sample's lines in predictions.jsonl: what every variant kept, what it answered, how it scored and how
closely it followed the full cache (`ripplekv eval`'s output format; `docs/usage.md` lists the fields)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ripplekv.engine.evict import peak_entries
from ripplekv.methods.core.quantized import budget_bytes, kept_bytes
from ripplekv.runs.files import REFERENCE

QUESTION_CHARS = 300  # of the sample's question, kept on its full-cache line


@dataclass
class SampleLines:
    """What every line of one sample shares, and how a variant's line is written."""

    task: object
    record: dict
    tokenizer: object
    base: dict  # the fields every line of the sample has
    state: object  # the sample's prefill: what a budget's and the kept entries' bytes are counted on
    heads: int  # KV heads: a layer's entries per head are its total over this
    peak: int  # the sample's peak memory, as measured
    decode_budget: str | None = None  # "total" under a total decode budget, else None (the field is left out)

    @classmethod
    def of(cls, task, record: dict, tokenizer, sid: str, state, question, protocol: str, peak: int,
           decode_budget: str = "prompt") -> SampleLines:
        base = {
            "id": sid,
            "task": task.name,
            "category": task.category,
            "prompt_tokens": state.length + len(question),
            "compressed_tokens": state.length,
            "protocol": protocol,
            "length": record.get("length"),
            "answers": list(record["answers"]),
        }
        if record.get("all_classes"):  # classification tasks: `ripplekv score` needs the class names to rescore
            base["all_classes"] = list(record["all_classes"])
        base.update({field: record.get(field) for field in task.fields})  # a needle's depth, a question's difficulty
        total = decode_budget if decode_budget == "total" else None
        return cls(task, record, tokenizer, base, state, state.num_kv_heads, peak, total)

    def full(self, tokens: list[int]) -> dict:
        """The full cache's line: every entry a layer holds (a sliding layer: its window), KL 0 and agreement 1
        by definition, and the first QUESTION_CHARS characters of the question."""
        counts = np.repeat(np.asarray(self.state.capacities, dtype=np.int64)[:, None], self.heads, axis=1)
        line = self.line(REFERENCE, None, tokens, counts, 0.0, 1.0)
        question = str(self.record.get("input") or "").strip()
        if question:  # the start of the question, once per sample: what a results page shows beside the answers
            line["question"] = question[:QUESTION_CHARS]
        return line

    def infeasible(self, method: str, budget: int, why: str) -> dict:
        """A variant whose bytes cannot fit its budget on this prompt: no numbers (reports list it as infeasible,
        never rank it)."""
        return {**self.base, "method": method, "budget": budget, "infeasible": why, "prediction": None, "score": None,
                "kl": None, "agreement": None, "kv_budget_bytes": budget_bytes(self.state, budget)}

    def line(self, method: str, budget: int | None, tokens: list[int], counts: np.ndarray, kl: float, agreement: float,
             capacity: np.ndarray | None = None, quantizer=None) -> dict:
        """A variant's line: `counts` [L, H_kv] the entries it kept, `tokens` its answer, `capacity` what each
        (layer, KV head) was held at under a total decode budget, `quantizer` how its entries are stored (None:
        full precision; else a spec per layer, whose bits the line records when layers differ)."""
        from ripplekv.metrics.scoring import score_sample

        prediction = self.tokenizer.decode(tokens, skip_special_tokens=True)
        score = score_sample(self.task, prediction, self.record["answers"], self.record.get("all_classes"))
        per_layer = counts.sum(1)
        heads = self.heads
        fields = {
            **self.base,
            "method": method,
            "budget": budget,
            "prediction": prediction,
            "new_tokens": len(tokens),
            "score": float(score),
            "kept_entries": int(counts.sum()),
            "kl": float(kl),
            "agreement": float(agreement),
            # Entries per KV head in each layer (the mean over heads when heads differ; then head_budgets too).
            "layer_budgets": [int(t) // heads if t % heads == 0 else round(float(t) / heads, 3) for t in per_layer],
            "peak_memory_bytes": self.peak,
            "kv_bytes": kept_bytes(self.state, counts, quantizer),  # what the kept entries take (`methods.core.quantized`)
        }
        if budget is not None:  # the bytes budget B stands for on this prompt
            fields["kv_budget_bytes"] = budget_bytes(self.state, budget)
        if bool((counts != counts[:, :1]).any()):
            fields["head_budgets"] = counts.tolist()
        if quantizer is not None and len(set(quantizer)) > 1:  # per-layer bits (`methods.core.bit_allocation`)
            fields["layer_bits"] = [[spec.key_bits, spec.value_bits] for spec in quantizer]
        if self.decode_budget:  # absent under prompt budgets: those lines stay as they were before the option
            fields["decode_budget"] = self.decode_budget
            fields["peak_entries"] = peak_entries(counts, len(tokens) - 1, capacity)
        return fields
