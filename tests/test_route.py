"""Layer-wise routing: batched preferences equal the naive ones, a layer built to need early tokens is
routed away from recency, caps hold, placements keep the route's method counts, and the CLI writes
deterministic outputs that `routed` and `routed-ripplekv` read."""

import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from ripplekv.analysis.kept import kept_arrays
from ripplekv.engine.cache import build_cache
from ripplekv.engine.decode import forward_tokens, full_reference, kl_per_variant, measure_fidelity
from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.engine.recorders import WINDOW_QUERIES
from ripplekv.errors import UserError
from ripplekv.methods import make_method, parse_spec
from ripplekv.methods.core.catalog import build_methods
from ripplekv.pipeline.profile import split_prompt
from ripplekv.pipeline.route import (
    DEFAULT_CANDIDATES,
    RouteSettings,
    candidate_methods,
    choose_route,
    layer_keep,
    parse_caps,
    placement_prompt,
    preference_prompt,
    random_placements,
    route_prefill,
    stop_tokens,
)
from tests.conftest import invoke as run
from tests.conftest import load_script, tiny_llama, tiny_qwen2

preferences_one_trial_at_a_time = load_script("naive_route").preferences_one_trial_at_a_time

CANDIDATES = ("snapkv", "streamingllm", "random")
MARKERS = list(range(1, 9))  # token ids a built layer attends to
CONTEXT_DIM, MARKER_DIM = 0, 1  # residual dimensions the built layer reads


def random_prompt(length=180, probe=12, seed=3):
    ids = torch.randint(10, 101, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return split_prompt(f"s{seed}", ids, probe)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_batched_preferences_equal_a_prefill_per_trial(build):
    model, prompt = build(), random_prompt()
    candidates = candidate_methods(CANDIDATES)
    # batch 5 splits one layer's trials across passes
    settings = RouteSettings(methods=CANDIDATES, budget=40, probe_tokens=12, batch_size=5)
    batched = preference_prompt(model, prompt, candidates, settings)
    naive = preferences_one_trial_at_a_time(model, prompt, candidates, 40, 12)
    assert batched.shape == naive.shape == (4, 3)
    assert (batched > 0).all()
    assert np.allclose(batched, naive, atol=1e-5, rtol=1e-3)


def early_token_model(layer: int):
    """A tiny Llama whose `layer` attends almost only to marker tokens, wherever they are.

    Queries and keys of that layer live in the lowest-frequency RoPE pair only (nearly no rotation over a
    few hundred positions): every query reads a dimension all tokens share, keys read a dimension only
    marker tokens carry, and values read the marker dimension strongly, so losing the markers changes
    the layer's output a lot. No layer writes the two dimensions, so they stay clean in the residual.
    """
    model = tiny_llama()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    slow = head_dim - 1  # with rotate_half, dims (head_dim/2 - 1, head_dim - 1) turn slowest
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, CONTEXT_DIM] = 0.3
        embed[:, MARKER_DIM] = 0.0
        embed[MARKERS, MARKER_DIM] = 0.3
        for block in model.model.layers:
            block.self_attn.o_proj.weight[[CONTEXT_DIM, MARKER_DIM]] = 0.0
            block.mlp.down_proj.weight[[CONTEXT_DIM, MARKER_DIM]] = 0.0
        attention = model.model.layers[layer].self_attn
        attention.q_proj.weight.zero_()
        attention.k_proj.weight.zero_()
        for head in range(config.num_attention_heads):
            attention.q_proj.weight[head * head_dim + slow, CONTEXT_DIM] = 2.0
        for head in range(config.num_key_value_heads):
            attention.k_proj.weight[head * head_dim + slow, MARKER_DIM] = 2.0
        attention.v_proj.weight[:, MARKER_DIM] = 0.5
    return model


def test_a_layer_that_needs_early_tokens_is_routed_away_from_recency():
    built = 2
    model = early_token_model(built)
    ids = random_prompt(length=200).context + random_prompt(length=200).probe
    ids[8:16] = MARKERS  # early, past StreamingLLM's 4 sinks
    prompt = split_prompt("markers", ids, 12)
    candidates = candidate_methods(CANDIDATES)
    kl = preference_prompt(model, prompt, candidates, RouteSettings(methods=CANDIDATES, budget=48, probe_tokens=12))
    route = choose_route(kl, [m.label for m in candidates])
    assert route[built] != "streamingllm"
    recency, snap = kl[built, CANDIDATES.index("streamingllm")], kl[built, CANDIDATES.index("snapkv")]
    assert recency > 100 * snap
    # the built layer is the one where recency hurts most
    assert kl[:, CANDIDATES.index("streamingllm")].argmax() == built


def test_route_is_the_per_layer_minimum_without_caps():
    prefs = np.random.default_rng(0).random((7, 3))
    assert choose_route(prefs, ["a", "b", "c"]) == [["a", "b", "c"][i] for i in prefs.argmin(1)]


def test_caps_hold_and_the_capped_route_is_optimal():
    rng = np.random.default_rng(1)
    prefs = rng.random((6, 3))
    prefs[:, 0] -= 0.5  # "a" is best almost everywhere
    labels = ["a", "b", "c"]
    caps = parse_caps(["a=0.34"], labels, 6)
    assert caps == {"a": 2, "b": 6, "c": 6}
    route = choose_route(prefs, labels, caps)
    assert route.count("a") == 2

    def cost(r):
        return sum(prefs[i, labels.index(m)] for i, m in enumerate(r))

    best = min(cost(r) for r in itertools.product(labels, repeat=6) if r.count("a") <= 2)
    assert cost(route) == pytest.approx(best)
    assert parse_caps(["0.5"], labels, 6) == {"a": 3, "b": 3, "c": 3}


@pytest.mark.parametrize(
    "items, message",
    [(["a=1.5"], "must be a number in (0, 1]"), (["z=0.5"], "'z' is not a candidate"), (["0.2"], "allow only 3 of 6"),
     (["a=x"], "must be a number")],
)
def test_bad_caps_are_user_errors(items, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_caps(items, ["a", "b", "c"], 6)


def test_placements_keep_method_counts_and_are_seeded():
    route = ["a"] * 5 + ["b"] * 3 + ["c"] * 2
    first = random_placements(route, 20, seed=4)
    assert all(sorted(p) == sorted(route) for p in first)
    assert first == random_placements(route, 20, seed=4) and first != random_placements(route, 20, seed=5)
    assert len({tuple(p) for p in first}) > 15


def test_a_placement_scores_as_the_routed_method_does(tmp_path):
    """The route's placement variant is exactly what `routed` builds at the same budget."""
    model, prompt = tiny_llama(), random_prompt(length=200)
    candidates = candidate_methods(CANDIDATES)
    route = ["snapkv", "random", "streamingllm", "snapkv"]
    settings = RouteSettings(methods=CANDIDATES, budget=40, probe_tokens=12, max_new_tokens=6)
    scores = placement_prompt(model, prompt, candidates, [route, route[::-1]], settings, stop_tokens(model))
    path = tmp_path / "ROUTE.csv"
    pd.DataFrame({"layer": range(4), "method": route}).to_csv(path, index=False)
    state = route_prefill(model, prompt.context + prompt.probe, candidates, 12, 6)
    reference = full_reference(model, state, 6, stop_tokens(model))
    direct = measure_fidelity(model, state, [make_method("routed", route=str(path)).compress(state, 40)], reference)
    assert scores[0].kl == pytest.approx(direct[0].kl, rel=1e-5, abs=1e-7)
    assert scores[0].kl != pytest.approx(scores[1].kl)


def eval_compressed(model, ids, spec: str, budget: int, reserve: int = 0):
    """What `ripplekv eval --methods SPEC` keeps for a prompt of these ids: its methods (full + SPEC, built
    as eval builds them), one prefill for what they declare, SPEC's compressed layers at `budget`."""
    methods = build_methods([spec], {})
    state = prefill_for(model, ids, Requirements.of_all(methods.values()), reserve=reserve)
    return state, methods[make_method(spec).label].compress(state, budget)


@pytest.mark.parametrize("specs, probe_tokens", [
    (DEFAULT_CANDIDATES, 12),  # probe shorter than SnapKV's window (32)
    (("snapkv:window=8", "snapkv:kernel=3:window=48", "h2o:recent=0:window=16", "knorm:window=4", "tova"), 80),
])  # ^ probe longer than every window and than the default captured window (64)
def test_route_trials_use_the_observation_window_eval_gives_each_method(specs, probe_tokens):
    """Route's (layer, method) trial keeps in layer l exactly what eval keeps there with that method alone:
    each candidate scores with its own window (SnapKV's 32, a spec's window=), never the probe's, although
    route's prefill captures max(probe, windows, 64) queries. Scoring with the probe as the window would not."""
    model, budget = tiny_llama(), 40
    prompt = random_prompt(length=200, probe=probe_tokens)
    candidates = candidate_methods(specs)
    route_state = route_prefill(model, prompt.context, candidates, probe_tokens, len(prompt.probe))
    assert route_state.signal(WINDOW_QUERIES)[0].shape[1] == max(64, probe_tokens)
    probe_windowed = 0
    for method in candidates:
        _, compressed = eval_compressed(model, prompt.context, method.label, budget)
        kept = kept_arrays(compressed)["positions"]
        for layer in range(route_state.num_layers):
            mask = layer_keep(route_state, method, layer, budget)
            route_sets = [set(torch.nonzero(row).flatten().tolist()) for row in mask]
            eval_sets = [{int(p) for p in row if p >= 0} for row in kept[layer]]
            assert route_sets == eval_sets, (method.label, layer)
            if "window" in method.describe()["scorer"]:  # the old worry: the probe window instead of the method's
                name, options = parse_spec(method.label)
                wrong = make_method(name, **{**options, "window": str(probe_tokens)})
                probe_windowed += bool((layer_keep(route_state, wrong, layer, budget) != mask).any())
    assert probe_windowed > 0  # the test tells the two apart


def test_route_preferences_are_the_kl_of_eval_s_compressed_layer():
    """preferences[l, m] = KL at the probe tokens with layer l as eval compresses it with m (the others full)."""
    model, budget = tiny_llama(), 40
    prompt = random_prompt(length=200, probe=12)
    candidates = candidate_methods(DEFAULT_CANDIDATES)
    settings = RouteSettings(methods=DEFAULT_CANDIDATES, budget=budget, probe_tokens=12, batch_size=7)
    preferences = preference_prompt(model, prompt, candidates, settings)
    probe = torch.tensor(prompt.probe, dtype=torch.long)[None]
    for index, method in enumerate(candidates):
        state, compressed = eval_compressed(model, prompt.context, method.label, budget, reserve=len(prompt.probe))
        full = [state.full_entries(layer) for layer in range(state.num_layers)]

        def logprobs(layers, state=state):
            logits = forward_tokens(model, build_cache(state, [layers]), probe, len(prompt.context))
            return torch.log_softmax(logits[0], -1)

        with torch.inference_mode():
            clean = logprobs(full)
            for layer in range(state.num_layers):
                kl = float(kl_per_variant(clean, logprobs([*full[:layer], compressed[layer], *full[layer + 1:]])))
                assert preferences[layer, index] == pytest.approx(kl, rel=1e-3, abs=1e-5), (method.label, layer)


def test_candidates_are_checked():
    with pytest.raises(UserError, match="candidate method 'nosuch' is not registered"):
        candidate_methods(["snapkv", "nosuch"])
    with pytest.raises(UserError, match="cannot be routed to"):
        candidate_methods(["full"])
    with pytest.raises(UserError, match="twice"):
        candidate_methods(["snapkv", "snapkv"])
    assert [m.label for m in candidate_methods(DEFAULT_CANDIDATES)] == list(DEFAULT_CANDIDATES)




@pytest.fixture(scope="module")
def routed(tiny_model_dir, tmp_path_factory):
    outs = []
    for name in ("first", "again"):
        out = tmp_path_factory.mktemp(name)
        result = run("route", "--model", tiny_model_dir, "--methods", ",".join(CANDIDATES), "--calib-samples", 2,
                     "--placements", 6, "--placement-samples", 2, "--target-tokens", 300, "--budget", 48,
                     "--max-new-tokens", 8, "--max-share", "streamingllm=0.5", "--out", out)
        assert result.returncode == 0, result.stderr
        outs.append((out, result))
    return outs


@pytest.mark.slow
def test_route_cli_writes_every_output_deterministically(routed):
    (out, result), (again, _) = routed
    route = pd.read_csv(out / "ROUTE.csv")
    assert list(route.columns) == ["layer", "method", *(f"kl_{m}" for m in CANDIDATES)]
    assert len(route) == 4 and set(route["method"]) <= set(CANDIDATES)
    assert (route["method"] == "streamingllm").sum() <= 2
    prefs = pd.read_csv(out / "preferences.csv")
    assert list(prefs.columns) == ["layer", *CANDIDATES] and (prefs[list(CANDIDATES)] > 0).all().all()
    assert len(pd.read_csv(out / "preferences_per_sample.csv")) == 2 * 4 * 3
    placements = pd.read_csv(out / "placements.csv")
    assert len(placements) == 7 and placements["is_route"].sum() == 1
    counts = sorted(route["method"])
    assert all(sorted(p.split(";")) == counts for p in placements["methods"])
    meta = __import__("json").loads((out / "route.json").read_text())
    assert meta["placement_rank"] == 1 + int((placements["kl"][1:] < placements["kl"][0]).sum())
    assert not set(meta["calibration_ids"]) & set(meta["placement_ids"])
    assert f"route ranks {meta['placement_rank']} of 7" in result.stderr
    # Split-half stability: each half's route (one prompt each here), under the same caps, and their agreement.
    half = meta["split_half"]
    assert half["samples"] == [1, 1] and half["layers"] == 4 and 0 <= half["agreement"] <= 4
    assert all((pd.Series(r) == "streamingllm").sum() <= 2 for r in half["routes"])
    assert f"agree on {half['agreement']} of 4 layers" in result.stderr
    assert list(placements.columns) == ["placement", "is_route", "kl", "agreement", "kl_minus_route", "diff_low",
                                        "diff_high", "p_value", "p_holm", "verdict", "methods"]
    study = meta["placement_study"]
    assert study["samples"] == 2 and study["placements"] == 6 and study["rank"] == meta["placement_rank"]
    assert study["significantly_better"] == (placements["verdict"] == "better").sum()
    assert study["rank_range_by_significance"][0] <= meta["placement_rank"] <= study["rank_range_by_significance"][1]
    per_sample = pd.read_csv(out / "placements_per_sample.csv")
    assert len(per_sample) == 2 * 7
    assert per_sample.groupby("placement")["kl"].mean().to_numpy() == pytest.approx(placements["kl"].to_numpy())
    assert f"{study['significantly_better']} of 6 placements significantly better" in " ".join(result.stderr.split())
    for name in ("preferences.png", "ROUTE.png", "placements.png"):
        assert (out / name).stat().st_size > 1000
    for name in ("ROUTE.csv", "preferences.csv", "placements.csv", "placements_per_sample.csv"):
        assert (out / name).read_bytes() == (again / name).read_bytes()


@pytest.mark.slow
def test_routed_and_routed_ripplekv_read_the_route(routed, tiny_model_dir, tmp_path):
    out = routed[0][0]
    alloc = tmp_path / "alloc.csv"
    alloc.write_text("layer,multiplier\n0,2\n1,1\n2,0.5\n3,0.5\n")
    result = run("budgets", "--model", tiny_model_dir, "--methods", "routed,routed-ripplekv", "--route", out / "ROUTE.csv",
                 "--allocation", alloc, "--budget", 64, "--prompt-len", 1000, "--format", "csv")
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(__import__("io").StringIO(result.stdout))
    routed_budgets = table[table["method"] == "routed"]["budget"].tolist()
    ripple_budgets = table[table["method"] == "routed-ripplekv"]["budget"].tolist()
    assert routed_budgets == [64] * 4 and sum(ripple_budgets) == 4 * 64 and ripple_budgets[0] > ripple_budgets[3]


@pytest.mark.slow
def test_eval_config_records_the_route_file_and_its_hash(routed, tiny_model_dir):
    import hashlib

    from ripplekv.pipeline import eval_plan

    route = routed[0][0] / "ROUTE.csv"
    settings = eval_plan.EvalSettings(budgets=(64,), methods=("snapkv", "routed"), route=str(route), model=str(tiny_model_dir))
    config = eval_plan.plan_eval(settings).config
    assert config["route"] == str(route.resolve())
    assert config["route_sha256"] == hashlib.sha256(route.read_bytes()).hexdigest()
    assert eval_plan.plan_eval(eval_plan.EvalSettings(budgets=(64,), methods=("snapkv",), model=str(tiny_model_dir))).config["route"] is None


def test_route_cli_errors_are_one_line(tiny_model_dir, tmp_path):
    for args, message in [
        (["--methods", "snapkv,nosuch"], "candidate method 'nosuch' is not registered"),
        (["--methods", "snapkv", "--budget", "0"], "budget must be a positive integer"),
        (["--methods", "snapkv,streamingllm", "--max-share", "snapkv=2"], "must be a number in (0, 1]"),
    ]:
        result = run("route", "--model", tiny_model_dir, *args, "--out", tmp_path / "r")
        assert result.returncode == 2 and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_placement_verdict_on_synthetic_kls():
    """12 samples; placement KLs = the route's + a shift + noise: clearly lower, clearly higher, or equal."""
    from ripplekv.analysis.placement import placement_verdict

    rng = np.random.default_rng(0)
    route = rng.uniform(1.0, 2.0, size=12)
    shifts = [-0.5] * 3 + [0.5] * 10 + [0.0] * 5
    columns = [route] + [route + shift + rng.normal(0, 0.05, size=12) * (shift != 0) for shift in shifts]
    kl = np.stack(columns, axis=1)
    verdict = placement_verdict(kl)
    assert verdict.verdict == ["route"] + ["better"] * 3 + ["worse"] * 10 + ["tie"] * 5
    assert (verdict.better, verdict.worse, verdict.placements) == (3, 10, 18)
    assert verdict.rank == 4 and verdict.rank_low == verdict.rank_high == 4  # the three better ones in every resample
    summary = verdict.summary()
    assert summary["rank_range_by_significance"] == [4, 9] and summary["share_worse"] == pytest.approx(10 / 18)
    assert np.allclose(verdict.difference, kl.mean(0) - kl.mean(0)[0])
    assert (verdict.low <= verdict.difference + 1e-12).all() and (verdict.difference <= verdict.high + 1e-12).all()
    assert "route ranks 4 of 19" in verdict.line() and "3 of 18 placements significantly better" in verdict.line()
    # A noisy placement whose mean sits near the route's gets an interval around 0 and a rank interval that spans it.
    noise = rng.normal(0, 0.5, size=12)
    noisy = np.stack([route, route + noise - noise.mean()], axis=1)
    near = placement_verdict(noisy)
    assert near.low[1] < 0 < near.high[1] and near.verdict[1] == "tie" and near.rank_low == 1 and near.rank_high == 2
    # The same data and seed give the same verdict (the bootstrap is seeded).
    again = placement_verdict(kl)
    assert np.array_equal(again.low, verdict.low) and again.rank_low == verdict.rank_low
