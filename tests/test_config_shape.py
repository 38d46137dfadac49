"""ConfigShape: the one reader of a config's layer and head counts."""

from types import SimpleNamespace

from ripplekv.engine.config_shape import ConfigShape, config_shape


def test_grouped_query_counts_and_group():
    shape = ConfigShape.of(SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                           hidden_size=576))
    assert (shape.layers, shape.query_heads, shape.kv_heads, shape.hidden, shape.group) == (30, 9, 3, 576, 3)


def test_a_config_without_grouped_query_attention_has_a_kv_head_per_query_head():
    shape = ConfigShape.of(SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, hidden_size=64))
    assert (shape.kv_heads, shape.group) == (8, 1)


def test_a_multimodal_config_is_read_through_its_text_config():
    text = SimpleNamespace(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, hidden_size=640)
    shape = ConfigShape.of(SimpleNamespace(text_config=text, num_attention_heads=99))
    assert (shape.layers, shape.query_heads, shape.kv_heads, shape.hidden) == (18, 4, 1, 640)


def test_the_bundled_model_from_its_config_alone():
    assert config_shape(None) == ConfigShape(layers=30, query_heads=9, kv_heads=3, hidden=576)
