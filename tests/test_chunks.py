"""Chunk-level selection (ChunkKV, its entropy gate, ChunkPress: `methods.core.chunks`, options of every window
scorer) and LagKV (`methods.lagkv`), each held against its rule written out here by the letter, on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ripplekv.engine.prefill import Requirements, prefill
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from tests.conftest import satisfy, tiny_llama

N = 120
LAYERS, KV, Q = 4, 2, 4
GROUP = Q // KV
MINE = ["chunkkv", "eg-chunkkv", "chunkpress", "lagkv"]


@pytest.fixture(scope="module")
def setup():
    """Our prefill of a tiny Llama and, from an identical copy, its eager attention maps."""
    ids = torch.randint(3, 101, (N,), generator=torch.Generator().manual_seed(1))
    methods = [make_method(spec) for spec in (*MINE, "snapkv:window=8", "expected-attention")]
    state = satisfy(prefill(tiny_llama(), ids, requirements=Requirements.of_all(methods)))
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=ids[None], output_attentions=True, use_cache=True)
    return state, out


def ranked(scores, positions) -> list[int]:
    """`positions` by score, highest first, ties to the earlier position."""
    return sorted(positions, key=lambda p: (-scores[p], p))


def kept(mask_row: torch.Tensor) -> set[int]:
    return set(mask_row.nonzero().flatten().tolist())


def pieces(start: int, stop: int, length: int) -> list[tuple[int, int]]:
    return [(a, min(a + length, stop)) for a in range(start, stop, length)]


def chunkkv_by_hand(summed, stop: int, length: int, extra: int) -> set[int]:
    """Whole chunks by mean while they fit, the remainder from the next chunk's best entries."""
    chunks = pieces(0, stop, length)
    means = [float(np.mean(summed[a:b])) for a, b in chunks]
    chosen: set[int] = set()
    for j in sorted(range(len(chunks)), key=lambda j: (-means[j], j)):
        a, b = chunks[j]
        if b - a > extra:
            return chosen | set(ranked(summed, range(a, b))[:extra])
        chosen |= set(range(a, b))
        extra -= b - a
        if extra == 0:
            break
    return chosen


def gated_by_hand(summed, length: int, spiky: int, extra: int) -> set[int]:
    """kvpress's entropy-gated ChunkKV, by its description: spiky important chunks keep `spiky` entries."""
    chunks = pieces(0, len(summed), length)
    means = [float(np.mean(summed[a:b])) for a, b in chunks]

    def entropy(values):
        if len(values) == 1:
            return 0.0
        low = min(values)
        values = [v - low for v in values] if low < 0 else list(values)
        total = sum(values)
        p = [v / (total + 1e-8) for v in values]
        return min(max(-sum(q * math.log(q + 1e-8) for q in p) / math.log(len(values)), 0.0), 1.0)

    entropies = [entropy(list(summed[a:b])) for a, b in chunks]
    score_median = sorted(means)[(len(means) - 1) // 2]  # the lower middle, as torch's median
    entropy_median = sorted(entropies)[(len(entropies) - 1) // 2]
    chosen: set[int] = set()
    for j in sorted(range(len(chunks)), key=lambda j: (-means[j], j)):
        if extra == 0:
            break
        a, b = chunks[j]
        take = min(b - a, extra)
        if means[j] >= score_median and entropies[j] < entropy_median:
            take = min(take, spiky)
        chosen |= set(ranked(summed, range(a, b))[:take])
        extra -= take
    rest = [p for p in range(len(summed)) if p not in chosen]
    return chosen | set(ranked(summed, rest)[:extra])


def test_chunkkv_keeps_whole_chunks_of_snapkv_scores_summed_over_heads(setup):
    state, out = setup
    method = make_method("snapkv:window=8:chunk_length=10")
    for layer in range(LAYERS):
        maps = out.attentions[layer][0, :, -8:, :].float()
        base = maps.sum(1).view(KV, GROUP, N).mean(1)[:, : N - 8]
        base = F.max_pool1d(base[:, None], 7, stride=1, padding=3)[:, 0]  # SnapKV's scores, by the letter
        summed = base.sum(0).double().numpy()
        for count in (30, 45, 96):
            mask = method.scorer.keep(state, layer, torch.tensor([count, count]))
            expected = chunkkv_by_hand(summed, N - 8, 10, count - 8) | set(range(N - 8, N))
            assert kept(mask[0]) == kept(mask[1]) == expected and len(expected) == count
        # heads that keep different counts (a head split) still rank the chunks by every head's scores
        mask = method.scorer.keep(state, layer, torch.tensor([30, 61]))
        for head, count in enumerate((30, 61)):
            assert kept(mask[head]) == chunkkv_by_hand(summed, N - 8, 10, count - 8) | set(range(N - 8, N))


def test_chunkkv_kvpress_rounding_keeps_its_whole_chunks(setup):
    state, _ = setup
    scorer = make_method("knorm:chunk_length=16:chunk_rounding=kvpress").scorer
    for layer in range(LAYERS):
        summed = -state.keys[layer].float().norm(dim=-1).sum(0).double().numpy()
        chunks = pieces(0, N, 16)  # 7 whole chunks and one of 8
        means = [float(np.mean(summed[a:b])) for a, b in chunks]
        number = max(1, int(len(chunks) * (1 - (1 - 50 / N))))  # kvpress's count at ratio 1 - B/n
        best = sorted(range(len(chunks)), key=lambda j: (-means[j], j))[:number]
        expected = {p for j in best for p in range(*chunks[j])}
        mask = scorer.keep(state, layer, torch.tensor([50, 50]))
        assert kept(mask[0]) == kept(mask[1]) == expected


@pytest.mark.parametrize("spec", ["knorm:chunk_length=16:chunk_rounding=kvpress", "chunkkv:chunk_rounding=kvpress",
                                  "knorm:segment_length=32:chunk_rounding=kvpress"])
def test_kvpress_rounding_budgets_are_the_counts_it_keeps(setup, spec):
    """`budgets` is what eval allocates, sizes caches by and checks every build against: under kvpress's rounding
    it is the number of entries kept (whole chunks, each segment's floor), not the budget."""
    from ripplekv.engine.schedule import entry_counts

    state, _ = setup
    method = make_method(spec)
    counts = method.budgets(state, 50)
    assert np.array_equal(counts, entry_counts(method.compress(state, 50)))
    assert (counts != 50).any()  # the rounding keeps another number here, so the check means something


@pytest.mark.parametrize("spec", ["knorm:chunk_length=10:gate=entropy", "keydiff:window=0:chunk_length=12:gate=entropy:spiky_keep=3"])
def test_the_entropy_gate_follows_kvpress_rule(setup, spec):
    state, _ = setup
    method = make_method(spec)
    for layer in range(LAYERS):
        summed = method.scorer.scores(state, layer).sum(0).double().numpy()
        if spec.startswith("knorm"):  # KNorm's scores are minus the key norms, checked here by the letter too
            assert np.allclose(summed, -state.keys[layer].float().norm(dim=-1).sum(0).numpy(), atol=1e-5)
        for count in (17, 40, 77):
            mask = method.scorer.keep(state, layer, torch.tensor([count, count]))
            expected = gated_by_hand(summed, method.scorer.chunk_length, method.scorer.spiky_keep, count)
            assert kept(mask[0]) == kept(mask[1]) == expected and len(expected) == count


def test_chunkpress_gives_each_segment_its_share_by_each_heads_scores(setup):
    state, _ = setup
    method = make_method("knorm:window=4:segment_length=32")
    for layer in range(LAYERS):
        scores = -state.keys[layer].float().norm(dim=-1).double().numpy()
        mask = method.scorer.keep(state, layer, torch.tensor([44, 44]))
        # 40 past the window over segments of 32, 32, 32, 20: 11.03, 11.03, 11.03, 6.9 -> 11, 11, 11, 7
        for head in range(KV):
            expected = set(range(N - 4, N))
            for (a, b), share in zip(pieces(0, N - 4, 32), (11, 11, 11, 7), strict=True):
                expected |= set(ranked(scores[head], range(a, b))[:share])
            assert kept(mask[head]) == expected


def test_chunkpress_kvpress_rounding_gives_each_segment_its_own_floor(setup):
    state, _ = setup
    scorer = make_method("knorm:segment_length=32:chunk_rounding=kvpress").scorer
    mask = scorer.keep(state, 2, torch.tensor([50, 50]))
    scores = -state.keys[2].float().norm(dim=-1).double().numpy()
    for head in range(KV):
        expected = set()
        for a, b in pieces(0, N, 32):
            expected |= set(ranked(scores[head], range(a, b))[: max(1, int((b - a) * (1 - (1 - 50 / N))))])
        assert kept(mask[head]) == expected and len(expected) == 13 + 13 + 13 + 10  # not 50: kvpress's rounding


def lagkv_by_hand(keys: np.ndarray, values: np.ndarray, sink: int, lag: int, cross: bool) -> np.ndarray:
    """LagKV's scores [H, n] written out loop by loop: partitions after the sinks, each scored against the next."""
    heads, n, dim = keys.shape
    scores = np.ones((heads, n))
    if n < sink + 2 * lag:
        scores[:, sink:] = np.arange(n - sink) / (n - sink)
        return scores
    parts = (n - sink) // lag
    for h in range(heads):
        for part in range(parts - 1):
            here = range(sink + part * lag, sink + (part + 1) * lag)
            after = range(sink + (part + 1) * lag, sink + (part + 2) * lag)
            mixed = np.zeros(lag)
            for states in (keys, values):
                spread = np.zeros(lag)
                for i, token in enumerate(here):
                    normalized = [(states[h, token, c] - min(states[h, t, c] for t in after))
                                  / (max(states[h, t, c] for t in after) - min(states[h, t, c] for t in after))
                                  for c in range(dim)]
                    spread[i] = np.std(normalized, ddof=1)
                mixed += np.exp(spread) / np.exp(spread).sum() / 2
            if not cross:
                order = sorted(range(lag), key=lambda i: (mixed[i], i))
                mixed = np.array([order.index(i) for i in range(lag)]) / lag
            scores[h, list(here)] = mixed
    return scores


@pytest.mark.parametrize("spec", ["lagkv:lag_size=16", "lagkv:lag_size=24:n_sink=2:cross_scoring=1", "lagkv:lag_size=64"])
def test_lagkv_scores_are_lag_relative_ranks(setup, spec):
    state, out = setup
    scorer = make_method(spec).scorer
    for layer in range(LAYERS):
        cache = out.past_key_values.layers[layer]
        expected = lagkv_by_hand(cache.keys[0].double().numpy(), cache.values[0].double().numpy(), scorer.n_sink,
                                 scorer.lag_size, bool(scorer.cross_scoring))
        assert np.allclose(scorer.scores(state, layer).numpy(), expected, atol=1e-5)
        mask = scorer.keep(state, layer, torch.tensor([40, 40]))
        for head in range(KV):  # the top 40 (ties to the earlier entry): sinks and tail first, as they score 1
            assert kept(mask[head]) == set(ranked(expected[head], range(N))[:40])


@pytest.mark.parametrize("budget", [16, 40, 100])
@pytest.mark.parametrize("spec", [*MINE, "expected-attention:chunk_length=20", "snapkv:chunk_length=7:split=adakv",
                                  "pyramidkv:scorer=keydiff:segment_length=30", "lagkv:lag_size=16:chunk_length=10",
                                  "eg-chunkkv:scorer=expected-attention:window=0", "snapkv:allocator=global:chunk_length=9"])
def test_every_chunked_method_keeps_exactly_snapkvs_total(setup, spec, budget):
    state, _ = setup
    method = make_method(spec)
    built = method.compress(state, budget)
    counts = np.array([layer.counts.tolist() for layer in built])
    assert (counts == method.budgets(state, budget)).all()
    assert counts.sum() == sum(int(layer.counts.sum()) for layer in make_method("snapkv").compress(state, budget))
    assert counts.sum() == LAYERS * KV * budget


def test_sliding_layers_chunk_only_what_they_hold():
    from tests.conftest import HYBRID_WINDOW, tiny_gemma3

    ids = torch.randint(3, 101, (90,), generator=torch.Generator().manual_seed(2))
    methods = [make_method(spec) for spec in ("knorm:chunk_length=5", "knorm:chunk_length=5:gate=entropy",
                                              "knorm:segment_length=6")]
    state = prefill(tiny_gemma3(), ids, requirements=Requirements.of_all(methods))
    sliding = [layer for layer in range(state.num_layers) if state.held_from(layer) > 0]
    assert sliding
    for method in methods:
        masks = method.select(state, 12)
        assert int(masks.sum()) == state.num_layers * state.num_kv_heads * 12
        for layer in sliding:
            assert not bool(masks[layer, :, : 90 - HYBRID_WINDOW].any())


@pytest.mark.parametrize("spec, message", [
    ("snapkv:gate=entropy", "add chunk_length="),
    ("snapkv:chunk_length=4:gate=entropy", "must exceed spiky_keep"),
    ("snapkv:spiky_keep=2", "only applies with gate=entropy"),
    ("snapkv:chunk_rounding=kvpress", "only applies with chunk_length= or segment_length="),
    ("snapkv:chunk_length=10:segment_length=10", "not both"),
    ("snapkv:chunk_length=10:gate=peaks", "gate must be one of entropy"),
    ("chunkkv:chunk_rounding=paper", "chunk_rounding must be one of exact, kvpress"),
    ("eg-chunkkv:chunk_rounding=kvpress", "keeps exactly the budget"),
    ("h2o:chunk_length=10", "selects in its own way"),
    ("criticalkv:segment_length=100", "selects in its own way"),
    ("snapkv:chunk_length=0", "positive integer"),
    ("lagkv:cross_scoring=2", "cross_scoring must be 0 or 1"),
    ("lagkv:lag_size=0", "positive integer"),
])
def test_chunk_and_lagkv_mistakes_are_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        make_method(spec)


def test_two_spellings_of_one_chunked_method_are_one_method():
    from ripplekv.methods.core.spec import identity

    assert identity(make_method("chunkkv")) == identity(make_method("snapkv:chunk_length=20:chunk_rounding=exact"))
    assert make_method("eg-chunkkv").describe()["scorer"]["spiky_keep"] == 4
    assert "chunk_length" not in make_method("snapkv").describe()["scorer"]  # unchanged without chunks


def test_chunked_scorers_do_not_claim_a_decoding_policy():
    assert make_method("snapkv").decode_policy(4) is not None
    assert make_method("chunkkv").decode_policy(4) is None
    assert make_method("tova:segment_length=64").decode_policy(4) is None


@pytest.mark.slow
def test_an_eval_of_the_chunk_methods_and_lagkv_keeps_snapkvs_entries(tiny_model_dir, tmp_path, run_cli):
    import json

    specs = ["snapkv", *MINE, "expected-attention:chunk_length=20"]
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit",
                           "1", "--target-tokens", "300", "--methods", ",".join(specs), "--budget", "40",
                           "--batch-size", "6", "--out", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    compressed = [row for row in rows if row["method"] != "full"]
    assert {row["method"] for row in compressed} == set(specs)
    assert len({row["kept_entries"] for row in compressed}) == 1


@pytest.mark.slow
def test_an_eval_of_kvpress_rounding_runs_and_reports_the_entries_it_kept(tiny_model_dir, tmp_path, run_cli):
    """Before `budgets` counted kvpress's whole chunks, eval's check of every build against its allocation failed."""
    import json

    specs = ["snapkv", "chunkkv:chunk_rounding=kvpress", "chunkpress:scorer=knorm:segment_length=64:chunk_rounding=kvpress"]
    out = tmp_path / "run"
    code, _, err = run_cli("eval", "--model", str(tiny_model_dir), "--suite", "offline", "--tasks", "niah", "--limit",
                           "1", "--target-tokens", "300", "--methods", ",".join(specs), "--budget", "50", "--out", str(out))
    assert code == 0, err
    rows = {row["method"]: row for row in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    assert rows["chunkkv:chunk_rounding=kvpress"]["kept_entries"] < rows["snapkv"]["kept_entries"]
