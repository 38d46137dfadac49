"""The memory bound: variants built when their group decodes, groups within the bytes the budget leaves,
and the same predictions, KL and agreement however tight the bound."""

import pytest
import torch

from ripplekv.engine import malloc, memory
from ripplekv.engine.cache import build_cache, build_lazily
from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.errors import UserError
from ripplekv.methods.signals.column_sums import COLUMN_SUMS
from tests.conftest import every_method


def test_sizes_parse_with_their_units():
    assert memory.parse_bytes("8GiB") == 8 * 2**30
    assert memory.parse_bytes("500MB") == 500 * 10**6
    assert memory.parse_bytes("1.5 gib") == 3 * 2**29
    assert memory.parse_bytes("4096") == 4096
    for bad in ("", "lots", "8 GiBs", "-1GB", "0", "1e3"):
        with pytest.raises(UserError, match="memory_budget must be a size with a unit"):
            memory.parse_bytes(bad)


def test_lazy_building_gives_the_cache_built_from_all_variants(tmp_path):
    """Shared whole layers, padding across variants and heads, merged prototypes: tensor for tensor."""
    from tests.conftest import tiny_llama

    model = tiny_llama()
    state = prefill(model, torch.randint(0, 101, (90,), generator=torch.Generator().manual_seed(2)),
                    capture_window=32, requirements=Requirements(signals={COLUMN_SUMS}))
    methods = every_method(state.num_layers, tmp_path, kv_heads=state.num_kv_heads)
    for names in (("snapkv", "adakv", "gracekv", "pyramidkv"), ("full", "full"), ("full", "snapkv")):
        built = [methods[name].compress(state, budget) for name in names for budget in (8, 40)]
        lengths = [[layer.capacity for layer in variant] for variant in built]
        lazy, whole = build_lazily(state, iter(built), lengths), build_cache(state, built)
        for a, b in zip(lazy.layers, whole.layers):
            assert a.prompt_keys.shape == b.prompt_keys.shape and torch.equal(a.prompt_keys, b.prompt_keys)
            assert torch.equal(a.prompt_values, b.prompt_values)
            assert (a.prompt_bias is None) == (b.prompt_bias is None)
            assert a.prompt_bias is None or torch.equal(a.prompt_bias, b.prompt_bias)


def test_step_costs_count_what_a_group_holds():
    costs = memory.StepCosts(layers=2, kv_heads=2, query_heads=4, head_dim=8, element=4, hidden=32,
                             intermediate=64, vocab=100)
    assert costs.entry == 2 * (2 * 8 * 4 + 4)
    one = costs.group(1, [10, 30], fed=5, decoded=9)
    assert costs.group(3, [10, 30], fed=5, decoded=9) == 3 * one
    # One more entry in the longest layer: its bytes, and one more float32 score per query head and fed token
    # for the four intermediates (the attention, 4 x 5 x 39 x 16, outweighs the log-probs, 5 x 100 x 16).
    assert costs.group(1, [10, 31], fed=5, decoded=9) == one + costs.entry + 4 * 5 * 16


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from ripplekv.engine.models import load_model

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    return model, tokenizer


def sample_methods(folder):
    """A mix: a head split (AdaKV), a global competition, a merge (GraceKV), and one layer kept whole."""
    from ripplekv.methods import make_method

    allocation = folder / "whole-first.csv"
    allocation.write_text("layer,multiplier\n0,3.6\n1,0.2\n2,0.1\n3,0.1\n")
    names = ("full", "snapkv", "adakv", "layer-defensivekv", "gracekv", "ripplekv")
    return {name: make_method(name, shared={"allocation": str(allocation)}) for name in names}


def run_sample(loaded, methods, monkeypatch=None, tight: float | None = None, **options):
    from ripplekv.engine import schedule
    from ripplekv.pipeline import evaluate
    from ripplekv.tasks import get_tasks, load_samples

    model, tokenizer = loaded
    task = get_tasks("offline", ["niah"])[0]
    record = load_samples(task, tokenizer, limit=1, target_tokens=256)[0]
    if tight is not None:  # the real bound, set just above what the largest variant needs alone
        real, real_left = memory.variant_room, memory.room_left
        squeezed_budget = []

        def squeezed(model, state, reference, labels, lengths, count, budget, prefix, max_new):
            fixed = budget - real(model, state, reference, labels, lengths, count, budget, prefix, max_new)
            costs = memory.StepCosts.of(model, state)
            fed = max(1, prefix + len(reference.tokens) - 1)
            alone = max(costs.group(1, length, fed, fed + max_new) for length in lengths)
            squeezed_budget.append(fixed + int(tight * alone))
            return real(model, state, reference, labels, lengths, count, squeezed_budget[0], prefix, max_new)

        def squeezed_left(model, state, reference, lengths, count, budget):  # the same bound later
            return real_left(model, state, reference, lengths, count, squeezed_budget[0])

        monkeypatch.setattr(schedule, "variant_room", squeezed)
        monkeypatch.setattr(schedule, "room_left", squeezed_left)
    return evaluate.evaluate_sample(model, tokenizer, task, record, methods, (24, 160),
                                    evaluate.SampleSettings(**options), sid="s")


def test_a_tight_memory_bound_changes_no_prediction_kl_or_agreement(loaded, tmp_path, monkeypatch):
    """Groups of one or two variants (the bound) against groups of up to 16 (no bound to speak of)."""
    from ripplekv.engine import decode

    methods = sample_methods(tmp_path)
    sizes = []
    plan = decode.plan_groups
    monkeypatch.setattr(decode, "plan_groups", lambda *a, **k: [g for g in plan(*a, **k) if not sizes.append(len(g))])
    free = run_sample(loaded, methods, memory_budget=2**40)
    loose, sizes[:] = list(sizes), []
    bounded = run_sample(loaded, methods, monkeypatch, tight=1.5)
    assert max(loose) > 3 and max(sizes) <= 2 and len(sizes) > len(loose)
    kept_whole = [r for r in free if r["method"] == "ripplekv" and r["budget"] == 160]
    assert kept_whole[0]["layer_budgets"][0] == kept_whole[0]["compressed_tokens"]  # one layer kept whole
    assert [(r["method"], r["budget"]) for r in free] == [(r["method"], r["budget"]) for r in bounded]
    for a, b in zip(free, bounded):
        assert (a["prediction"], a["new_tokens"], a["agreement"], a["kept_entries"]) == \
            (b["prediction"], b["new_tokens"], b["agreement"], b["kept_entries"]), (a["method"], a["budget"])
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6, rel=1e-4)
        assert a["peak_memory_bytes"] > 0 and b["peak_memory_bytes"] > 0


def test_a_variant_that_cannot_fit_alone_is_one_line_naming_it(loaded, tmp_path):
    """Below the weights: the line names the settings as the library spells them (the Python API's argument
    names; the CLI writes its flags) and a bound that is then accepted (every variant of the sample fits in it,
    rounded up, from the sample's own tensors)."""
    import re

    with pytest.raises(UserError, match=r"(?s)at budget \d+ needs .* raise memory_budget to at least") as caught:
        run_sample(loaded, sample_methods(tmp_path), memory_budget=2**20)
    message = str(caught.value)
    assert "lower budgets or max_length" in message and "--" not in message
    bound = memory.parse_bytes(re.search(r"at least ([0-9.]+ [GM]iB)", message).group(1).replace(" ", ""))
    rows = run_sample(loaded, sample_methods(tmp_path), memory_budget=bound)
    assert len(rows) == 1 + 5 * 2


def test_the_peak_meter_sees_a_new_allocation():
    import gc

    # Free what earlier tests left for the collector first: freed after the meter's reset, it would lower the
    # resident size below the reset mark, and the new block could then fit under it unseen.
    gc.collect()
    meter = memory.PeakMemory("cpu")
    before = meter.peak()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert meter.peak() >= before + 60 * 2**20
    del block


def test_the_meter_tells_what_is_held_and_each_stretch_peak():
    import gc

    gc.collect()
    meter = memory.PeakMemory("cpu")
    block = torch.ones(48 * 2**20 // 4)  # 48 MiB, touched and held
    assert meter.grown() >= 40 * 2**20
    start = meter.current()
    meter.mark()
    passing = torch.ones(32 * 2**20 // 4)  # 32 MiB, freed before the mark: only the stretch's peak saw it
    del passing
    assert meter.mark() >= start + 28 * 2**20
    assert meter.peak() >= start + 28 * 2**20  # the whole work's peak keeps every stretch's
    del block


def test_freed_blocks_leave_the_resident_set_once_malloc_is_told():
    """What the CPU bound rests on: a group's tensors, freed, no longer count in the resident set."""
    import gc

    if not malloc.return_freed_memory():
        pytest.skip("not glibc: malloc cannot be told to return freed blocks")
    gc.collect()
    meter = memory.PeakMemory("cpu")
    for _ in range(3):  # without the fixed threshold, glibc keeps blocks of this size resident after the first free
        blocks = [torch.ones(20 * 2**20 // 4) for _ in range(4)]  # 80 MiB in 20 MiB blocks
        del blocks
    assert meter.grown() < 30 * 2**20


def _faults_while(churn) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_long_forward_reuses_freed_blocks_and_the_resident_set_returns_after(monkeypatch):
    """Within `keeping_freed_memory` a block freed and asked for again is not mapped afresh (the page faults that
    cost a 3.5k prefill ~1 s); when it ends the resident set is back and the thresholds are restored. Under a
    budget the user set (`allow_keeping(False)`) the block changes nothing."""
    import gc

    if not malloc.return_freed_memory():
        pytest.skip("not glibc: malloc cannot be told to return freed blocks")
    monkeypatch.setattr(malloc, "_KEEPING_ALLOWED", True)

    def churn():  # a forward's activations: the same 20 MiB blocks freed and asked for, layer after layer
        for _ in range(6):
            blocks = [torch.ones(20 * 2**20 // 4) for _ in range(3)]
            del blocks

    gc.collect()
    returned = _faults_while(churn)
    meter = memory.PeakMemory("cpu")
    with malloc.keeping_freed_memory():
        kept = _faults_while(churn)
    assert kept < returned / 3  # mapped once, not six times
    assert meter.grown() < 30 * 2**20  # handed back when the block ends
    calls = []
    monkeypatch.setattr(malloc, "_set_thresholds", lambda *sizes: calls.append(sizes) or True)
    with malloc.keeping_freed_memory():
        pass
    assert calls == [(malloc.KEEP_FREED_UP_TO, malloc.KEEP_FREE_TOP), (malloc.RETURN_FREED_ABOVE,)]  # restored after
    malloc.allow_keeping(False)
    with malloc.keeping_freed_memory():
        pass
    assert len(calls) == 2  # not allowed: the block changes nothing


def test_a_budget_the_user_set_keeps_no_freed_block(monkeypatch):
    from ripplekv.engine.schedule import SampleMemory
    from tests.conftest import tiny_llama

    monkeypatch.setattr(malloc, "_KEEPING_ALLOWED", True)
    model = tiny_llama()
    SampleMemory(model, 2**30)
    assert not malloc._KEEPING_ALLOWED
    SampleMemory(model)
    assert malloc._KEEPING_ALLOWED


def test_groups_are_planned_again_within_what_is_left_after_each():
    """A sample that holds more after its first group (scores a build cached) decodes the rest in smaller groups."""
    from ripplekv.engine import divergence
    from ripplekv.engine.decode import Reference, fidelity_groups
    from tests.conftest import tiny_llama

    model = tiny_llama()
    state = prefill(model, torch.randint(0, 101, (90,), generator=torch.Generator().manual_seed(2)), capture_window=16)
    reference = Reference([1, 2, 3], torch.zeros(3, 101))
    lengths = [[40] * state.num_layers for _ in range(12)]
    costs = memory.StepCosts.of(model, state)
    one = costs.group(1, lengths[0], 2, 2 + 3)
    roomy = 6 * one
    planned = fidelity_groups(model, state, lengths, reference, 16, None, roomy, 3)
    assert [len(g) for g in planned] == [6, 6]  # one plan: the same room throughout
    rooms = iter([2 * one, 2 * one, 2 * one])
    again = list(divergence._groups(model, state, lengths, reference, 16, None, roomy, 3, lambda: next(rooms)))
    assert [len(g) for g in again] == [6, 2, 2, 2]
    assert sorted(i for g in again for i in g) == list(range(12))


def test_a_prefill_past_the_budget_is_one_note_and_the_sample_goes_on(loaded, tmp_path, monkeypatch):
    import warnings

    from ripplekv.cli.options import flag
    from ripplekv.engine import schedule
    from ripplekv.errors import Notice

    class BigPrefill(memory.PeakMemory):  # the first stretch (prefill and reference) peaks 5 GiB above the start
        def mark(self):
            seen = super().mark()
            if not getattr(self, "marked", False):
                self.marked = True
                return self.origin + 5 * 2**30
            return seen

    monkeypatch.setattr(schedule, "PeakMemory", BigPrefill)
    monkeypatch.setattr(memory, "_SAID", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run_sample(loaded, sample_methods(tmp_path), memory_budget=4 * 2**30)
        run_sample(loaded, sample_methods(tmp_path), memory_budget=4 * 2**30)
    said = [w.message for w in caught if isinstance(w.message, Notice) and "the prefill" in str(w.message)]
    assert len(said) == 1  # once per process and budget
    assert "over memory_budget 4.00 GiB" in str(said[0]) and "max_length" in str(said[0])  # the settings' names
    assert "over --memory-budget 4.00 GiB" in said[0].phrased(flag) and "--max-length" in said[0].phrased(flag)
    assert len(rows) == 1 + 5 * 2  # every variant still decoded
