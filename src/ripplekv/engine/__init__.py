"""The engine: one prefill, entries, the per-head cache and its attention, batched decoding."""
