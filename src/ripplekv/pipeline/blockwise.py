"""`ripplekv eval --protocol blockwise`: each variant prefilled block by block on its own (`engine.blockwise`).

The sample's whole prompt is still prefilled once, for the full cache's answer (the fidelity reference, as under
with-question); then every (method, budget) variant reads the prompt in blocks, evicting to its budget after each,
and answers from its own cache and its own logits after the last token. So an eval's `peak_memory_bytes` holds the
whole-prompt reference and is not the bounded figure: `scripts/bench_memory.py --protocol blockwise` measures the
block-wise prefill alone. Each variant's line records `block_tokens`, `prefill_reads` and `prefill_peak_entries`
(the most entries one (layer, KV head) held during its prefill: at most budget + block).
"""

from __future__ import annotations

from ripplekv.engine import adapter
from ripplekv.engine.blockwise import decode_blockwise
from ripplekv.errors import UserError


def check_blockwise_model(config, protocol: str) -> None:
    """Block-wise prefill on a model with sliding-window layers is refused before its weights load: a block read
    through kept entries would have to slide them as the model does, which it does not yet."""
    from ripplekv.defaults import BLOCKWISE_PROTOCOL

    if protocol == BLOCKWISE_PROTOCOL and any(window is not None for window in adapter.layer_windows(config)):
        raise UserError("--protocol blockwise does not run models with sliding-window layers yet; use another "
                        "--protocol or a model whose layers all read the whole prompt")


def blockwise_variants(model, ids, state, reference, variants, decoding, memory, stops, block: int):
    """(`schedule.Decoded` per variant, in order; per (label, budget) the fields its line adds)."""
    pairs = decode_blockwise(model, ids, state, reference, variants, decoding, memory, stops, block)
    extra = {(one.variant.label, one.variant.budget): {"block_tokens": block, "prefill_reads": result.reads,
                                                       "prefill_peak_entries": result.peak_entries}
             for one, result in pairs}
    return [one for one, _ in pairs], extra
