"""What each method keeps: StreamingLLM's sinks and recent window, SnapKV's top scores plus the window."""

import pytest
import torch

from ripplekv.engine import entries
from ripplekv.engine.recorders import WINDOW_QUERIES
from ripplekv.errors import UserError
from ripplekv.methods import PRESETS, make_method, method_names
from ripplekv.methods.snapkv import window_scores
from tests.test_budgets import fake_state


def test_streamingllm_keeps_first_four_and_last_rest():
    state = fake_state(3, 200)
    masks = make_method("streamingllm").select(state, 20)
    expected = torch.zeros(200, dtype=torch.bool)
    expected[:4] = True
    expected[-16:] = True
    assert (masks == expected).all()


def test_snapkv_keeps_window_and_top_scored_prefix():
    state = fake_state(2, 300)
    method = make_method("snapkv", window=16, kernel=5)
    masks = method.select(state, 48)
    for layer in range(2):
        scores = window_scores(state, layer, 16, 5, "max")
        for head in range(state.num_kv_heads):
            kept = masks[layer, head]
            assert kept[-16:].all()
            prefix_kept = kept[:-16].nonzero().flatten()
            assert len(prefix_kept) == 32
            # Every kept prefix entry scores at least as high as every dropped one.
            dropped = (~kept[:-16]).nonzero().flatten()
            assert scores[head, prefix_kept].min() >= scores[head, dropped].max()


def test_snapkv_scores_match_a_direct_attention_computation():
    state = fake_state(1, 120, kv_heads=2, query_heads=4)
    scores = window_scores(state, 0, 8, 1, "none")
    q = state.signal(WINDOW_QUERIES)[0][:, -8:]
    k = torch.repeat_interleave(state.keys[0], 2, dim=0)
    logits = q @ k.transpose(-1, -2) * state.scaling
    positions = torch.arange(120)
    causal = positions[None, :] <= (112 + torch.arange(8))[:, None]
    attn = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).sum(1)  # [H_q, n]
    expected = attn.view(2, 2, 120).mean(1)[:, :112]
    assert torch.allclose(scores, expected, atol=1e-6)


def test_gathered_entries_are_the_kept_tokens_in_prompt_order():
    state = fake_state(1, 100)
    for name in ("snapkv", "random", "streamingllm"):
        mask = make_method(name).select(state, 30)[0]
        layer = make_method(name).compress(state, 30)[0]
        assert layer.bias() is None and layer.keys.shape == (2, 30, 8) and layer.counts.tolist() == [30, 30]
        for h in range(2):
            positions = mask[h].nonzero().flatten()
            assert torch.equal(layer.positions[h], positions)
            assert torch.equal(layer.keys[h], state.keys[0][h, positions])
            assert torch.equal(layer.values[h], state.values[0][h, positions])
            assert (positions[1:] > positions[:-1]).all()


def test_uneven_heads_are_padded_with_minus_infinity_and_positions_minus_one():
    state = fake_state(1, 50)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[0, [1, 7, 9]] = True
    mask[1, 40:] = True
    layer = entries.gather(state.keys[0], state.values[0], mask)
    assert layer.counts.tolist() == [3, 10] and layer.capacity == 10
    assert layer.positions[0].tolist() == [1, 7, 9] + [-1] * 7
    bias = layer.bias()
    assert (bias[0, :3] == 0).all() and torch.isinf(bias[0, 3:]).all() and (bias[1] == 0).all()


def test_registry_lists_methods_and_rejects_unknown():
    assert {"full", "uniform", "snapkv", "streamingllm", "pyramidkv", "ripplekv", "random", "adakv", "routed"} <= set(method_names())
    with pytest.raises(UserError, match="known methods: adakv"):
        make_method("no-such-method")


def test_uniform_is_snapkv_under_its_own_name():
    state = fake_state(3, 200)
    uniform, snap = make_method("uniform"), make_method("snapkv")
    assert uniform.label == "uniform" and uniform.describe()["scorer"] == snap.describe()["scorer"]
    assert torch.equal(uniform.select(state, 48), snap.select(state, 48))


def test_specs_set_options_swap_components_and_label_canonically():
    method = make_method("snapkv:kernel=5:window=16")
    assert method.label == "snapkv:kernel=5:window=16" == make_method("snapkv:window=16:kernel=5").label
    assert method.describe() == {"preset": "snapkv", "allocator": {"name": "uniform"},
                                 "scorer": {"name": "snapkv", "window": 16, "kernel": 5, "pooling": "max"}}
    swapped = make_method("ripplekv:scorer=random", multipliers=(1.0, 1.0))
    assert swapped.describe()["scorer"]["name"] == "random" and swapped.describe()["allocator"]["name"] == "file"
    # Shared (command-line) options reach only the methods that take them.
    assert make_method("streamingllm", shared={"window": 8, "allocation": "x.csv"}).describe()["scorer"] == {"name": "recency", "sinks": 4}
    assert make_method("snapkv", shared={"window": 8}).scorer.window == 8


def test_a_file_option_is_labelled_by_its_file_name(tmp_path):
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "depth.csv"
    path.write_text("layer,multiplier\n0,2\n1,0.5\n")
    method = make_method(f"depthkv:allocation={path}")
    assert method.label == "depthkv:allocation=depth.csv"
    assert method.describe()["allocator"]["allocation"] == str(path)  # the config keeps the whole path


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv:foo=1", "unknown option"),
        ("snapkv:window=abc", "must be an integer"),
        ("snapkv:window", "not key=value"),
        ("snapkv:window=8:window=9", "twice"),
        (":window=8", "empty method name"),
        ("full:window=8", "takes no options"),
        ("snapkv:scorer=nope", "unknown scorer"),
        ("snapkv:pooling=mean", "unknown pooling"),
        ("pyramidkv:beta=0.5", "beta"),
        ("adakv:alpha=2", "alpha"),
        ("adakv:rule=kvzip", "rule"),
        ("h2o:norm=max", "norm"),
        ("h2o:recent=1.5", "recent"),
        ("snapkv:window=0", "positive integer"),
        ("routed", "needs a route"),
    ],
)
def test_bad_specs_are_one_clear_error(spec, message):
    with pytest.raises(UserError, match=message):
        make_method(spec)


def test_keyword_options_are_never_silently_dropped():
    with pytest.raises(UserError, match="unknown option"):
        make_method("streamingllm", window=8)


def naive_ffy0_counts(scores: torch.Tensor, window: int, budget: int, alpha: float):
    """FFY0's rule from a pooled list: c_h = head h's share of the layer's top H*base prefix scores; real
    targets (1 - alpha) c_h + alpha base; plus FFY0's own per-head round (which need not sum exactly)."""
    heads, base = scores.shape[0], budget - window
    pool = sorted(((float(v), h) for h in range(heads) for v in scores[h].tolist()), reverse=True)[: heads * base]
    chosen = [sum(1 for _, h in pool if h == head) for head in range(heads)]
    targets = [(1 - alpha) * c + alpha * base for c in chosen]
    ffy0_round = [round(c * (1 - alpha) + int(base * alpha)) for c in chosen]
    return targets, ffy0_round


@pytest.mark.parametrize("budget, alpha", [(40, 0.2), (57, 0.5), (23, 0.0)])
def test_adakv_follows_ffy0s_rule_with_exact_totals(budget, alpha):
    state = fake_state(3, 300, kv_heads=3, query_heads=6, seed=11)
    method = make_method(f"adakv:window=8:alpha={alpha}:pooling=avg")  # max pooling ties scores
    counts = method.budgets(state, budget)
    assert counts.sum() == 3 * 3 * budget
    masks = method.select(state, budget)
    for layer in range(3):
        scores = method.scorer.scores(state, layer)
        targets, ffy0_round = naive_ffy0_counts(scores, 8, budget, alpha)
        prefix = counts[layer] - 8
        # Exact total; each head within one entry of its real target, and of FFY0's own rounding.
        assert prefix.sum() == 3 * (budget - 8)
        assert all(abs(int(c) - t) < 1 for c, t in zip(prefix, targets))
        assert all(abs(int(c) - r) <= 1 for c, r in zip(prefix, ffy0_round))
        for head in range(3):  # each head keeps the window and its own top prefix entries
            top = set(torch.argsort(scores[head], descending=True)[: int(prefix[head])].tolist())
            assert masks[layer, head, -8:].all() and set(masks[layer, head, :-8].nonzero().flatten().tolist()) == top
    if alpha < 1:
        assert len(set(counts.flatten().tolist())) > 1  # heads really differ on random scores


def test_adakv_floor_rule_keeps_our_earlier_split():
    """Naive reference: per layer, every head's window + floor share, then the best remaining scores of all heads."""
    state = fake_state(2, 300, kv_heads=3, query_heads=6, seed=4)
    method = make_method("adakv:window=8:rule=floor")
    counts = method.budgets(state, 40)
    assert counts.sum() == 2 * 3 * 40 and (counts >= 8 + int(0.2 * 32)).all()
    for layer in range(2):
        scores = method.scorer.scores(state, layer)
        floor_extra = int(0.2 * 32)
        ranked = torch.sort(scores, dim=-1, descending=True).values
        pool = sorted(((float(v), h) for h in range(3) for v in ranked[h, floor_extra:].tolist()), reverse=True)
        expected = [8 + floor_extra + sum(1 for _, h in pool[: 3 * 40 - 3 * (8 + floor_extra)] if h == head) for head in range(3)]
        assert counts[layer].tolist() == expected
    assert len(set(counts.flatten().tolist())) > 1  # heads really differ on random scores


def test_ripplekv_needs_an_allocation_and_a_matching_layer_count(tmp_path):
    with pytest.raises(UserError, match="ripplekv profile"):
        make_method("ripplekv")
    alloc = tmp_path / "alloc.csv"
    alloc.write_text("layer,multiplier\n0,1.5\n1,0.5\n")
    method = make_method("ripplekv", allocation=str(alloc))
    assert method.layer_budgets(2, 100, 1000) == [150, 50]
    with pytest.raises(UserError, match="2 layers but the model has 3"):
        method.layer_budgets(3, 100, 1000)


@pytest.mark.parametrize(
    "text, message",
    [
        ("layer,weight\n0,1\n", "lacks column"),
        ("layer,multiplier\n0,1\n0,2\n", "exactly once"),
        ("layer,multiplier\n0,1\n1,-1\n", "negative or non-numeric"),
        ("layer,multiplier\n0,0\n1,0\n", "one > 0"),
        ("layer,multiplier\n0,1\n1,abc\n", "negative or non-numeric"),
    ],
)
def test_malformed_allocation_is_one_clear_error(tmp_path, text, message):
    alloc = tmp_path / "alloc.csv"
    alloc.write_text(text)
    with pytest.raises(UserError, match=message):
        make_method("ripplekv", allocation=str(alloc))


def test_avg_pooling_counts_the_edge_padding_as_snapkv_does():
    state = fake_state(1, 60)
    raw = window_scores(state, 0, 8, 1, "none")
    pooled = window_scores(state, 0, 8, 5, "avg")
    # At the first position the window covers 2 pads + 3 entries and divides by 5 (count_include_pad=True).
    assert torch.allclose(pooled[:, 0], raw[:, :3].sum(-1) / 5, atol=1e-7)
    assert torch.allclose(pooled[:, 10], raw[:, 8:13].mean(-1), atol=1e-7)


# --------------------------------------------------------------------------- one name per method


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.alias_of])
def test_a_declared_alias_computes_what_it_names(name):
    from ripplekv.methods.core.spec import identity

    assert identity(make_method(name)) == identity(make_method(PRESETS[name].alias_of))


def test_aliases_are_computed_once_and_named_in_a_note():
    from ripplekv.methods.core.catalog import build_methods

    notes: list[str] = []
    methods = build_methods(["snapkv", "uniform", "adakv", "snapkv:split=adakv"], {}, notes)
    assert list(methods) == ["full", "snapkv", "adakv"]
    assert notes == [
        "note: uniform is another name for snapkv (the same method); computed once, as snapkv",
        "note: snapkv:split=adakv is another name for adakv (the same method); computed once, as adakv",
    ]


def test_only_the_same_computation_is_an_alias():
    from ripplekv.methods.core.spec import identity

    same = identity(make_method("adakv:alpha=0.1:window=16"))
    assert same == identity(make_method("snapkv:split=adakv:head_alpha=0.1:window=16"))
    assert same != identity(make_method("snapkv:split=adakv:window=16"))  # another safeguard
    assert identity(make_method("adakv:rule=floor")) != identity(make_method("snapkv:split=adakv"))  # another rule
    assert identity(make_method("uniform:window=16")) != identity(make_method("snapkv"))


def test_an_alias_keeps_the_same_entries(tiny_model):
    """What the identity promises: both spellings keep the same entries on a real prefill."""
    from ripplekv.engine.prefill import prefill_for

    ada, composed = make_method("adakv"), make_method("snapkv:split=adakv")
    state = prefill_for(tiny_model, torch.arange(150) % 97 + 3, ada.requirements())
    assert torch.equal(ada.select(state, 24), composed.select(state, 24))


def test_every_preset_has_a_family_from_the_table():
    """Families are a column of the preset table (no list kept by hand): every line has one, `ripplekv.list_methods()`
    reports it, and a line without one, or with a column the table does not have, is refused by name."""
    from ripplekv.methods.core.catalog import catalog
    from ripplekv.methods.core.presets import families, read_table

    assert all(chosen.family for chosen in PRESETS.values())
    assert {info.name: info.family for info in catalog()} == {name: p.family for name, p in PRESETS.items()}
    assert families()[0] == "reference" and {"uniform baselines", "answer-aware", "quantizers"} <= set(families())
    with pytest.raises(ValueError, match="preset 'x' needs family"):
        read_table('x = { allocator = "uniform", scorer = "snapkv", about = "SnapKV again" }')
    with pytest.raises(ValueError, match="preset 'x' has no column famliy"):
        read_table('x = { famliy = "uniform baselines", about = "SnapKV again" }')


def test_the_table_builds_the_methods_it_names():
    """A table line's class column names a registered method class: a method of its own or a checking subclass."""
    from ripplekv.methods.core.base import AllocatorScorer
    from ripplekv.methods.core.presets import read_table
    from ripplekv.methods.gracekv.method import GraceKV
    from ripplekv.methods.lukv.method import CurveMethod

    assert PRESETS["gracekv"].own is GraceKV and PRESETS["lukv"].kind is CurveMethod and PRESETS["lukv"].own is None
    assert PRESETS["snapkv"].kind is AllocatorScorer and PRESETS["full"].is_full
    assert type(make_method("gracekv")) is GraceKV and type(make_method("snapkv")) is AllocatorScorer
    (odd,) = read_table('odd = { family = "f", class = "nothing-registered", about = "a" }').values()
    with pytest.raises(ValueError, match="names class 'nothing-registered', which no module registers"):
        assert odd.own is None


# --------------------------------------------------------------------------- the registry


def test_a_conflicting_registration_is_refused_and_a_reload_is_not(monkeypatch):
    """Two modules claiming one name would make the last import win, silently; the registry refuses the second."""
    from dataclasses import dataclass

    from ripplekv.methods.core.registry import SCORERS, register_head_split, register_scorer
    from ripplekv.methods.snapkv import SnapKVScorer

    @dataclass(frozen=True)
    class Impostor(SnapKVScorer):
        pass

    with pytest.raises(ValueError, match="scorer 'snapkv' is already registered .*SnapKVScorer.*Impostor"):
        register_scorer("snapkv")(Impostor)
    assert SCORERS["snapkv"] is SnapKVScorer and SnapKVScorer.name == "snapkv"
    with pytest.raises(ValueError, match="head split 'adakv' is already registered"):
        register_head_split("adakv")(lambda state, per_layer, scorer, alpha: None)
    reloaded = type("SnapKVScorer", (SnapKVScorer,), {"__module__": SnapKVScorer.__module__,
                                                       "__qualname__": SnapKVScorer.__qualname__})
    monkeypatch.setitem(SCORERS, "snapkv", SnapKVScorer)  # put back after the test
    assert register_scorer("snapkv")(reloaded) is reloaded  # the same class defined again: a reload


def test_every_module_under_methods_is_imported_with_the_package():
    """A method registers by being there, wherever it sits: every module under methods/, subfolders included."""
    from pathlib import Path

    import ripplekv.methods as methods

    root = Path(methods.__file__).parent
    on_disk = {".".join(("ripplekv", "methods", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
               for path in root.rglob("*.py")} - {"ripplekv.methods"}
    assert set(methods.MODULES) == on_disk
    assert {"ripplekv.methods.gracekv.method", "ripplekv.methods.kvzap.method", "ripplekv.methods.lukv.method"} <= on_disk


def test_the_layer_allocators_are_what_each_allocator_declares():
    """`split=` composes with every allocator that leaves the head split to it; the refusal names them all, as each
    allocator declares it (a hand-kept list once left five out)."""
    from ripplekv.methods import ALLOCATORS
    from ripplekv.methods.core.base import layer_allocators

    assert set(layer_allocators()) >= {"uniform", "pyramid", "file", "cake", "global", "compresskv", "dynamickv",
                                       "lava", "pyramidinfer", "squeeze"}
    assert set(ALLOCATORS) - set(layer_allocators()) == {"adakv", "answer", "duoattention", "lukv"}
    for name in layer_allocators():
        if name not in ("file", "compresskv"):  # these read a file before they build
            make_method(f"snapkv:allocator={name}:split=adakv")
    with pytest.raises(UserError, match="splits heads itself.*squeeze, uniform\\)"):
        make_method("snapkv:allocator=adakv:split=adakv")


def test_file_options_are_what_each_component_declares(monkeypatch):
    """An option naming a file is marked on its field (`base.FILE`), never listed elsewhere: a new component's file
    option shows only its file name in labels as soon as it is registered."""
    from dataclasses import dataclass, field

    from ripplekv.methods.core.base import FILE
    from ripplekv.methods.core.registry import SCORERS
    from ripplekv.methods.core.spec import file_options
    from ripplekv.methods.snapkv import SnapKVScorer

    assert file_options() == {"allocation", "route", "profile", "curve", "weights", "gates"}

    @dataclass(frozen=True)
    class TableScorer(SnapKVScorer):
        table: str | None = field(default=None, metadata=FILE)

    monkeypatch.setitem(SCORERS, "table-scorer", TableScorer)
    assert "table" in file_options()
    assert make_method("snapkv:scorer=table-scorer:table=/some/where/t.csv").label == "snapkv:scorer=table-scorer:table=t.csv"
