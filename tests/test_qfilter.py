"""Q-Filters: the recorded query sums, the fit against numpy's SVD of the queries, the score's formula at exact budgets,
the one-line refusals and a resumed fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ripplekv.engine.prefill import Requirements, prefill_for
from ripplekv.errors import UserError
from ripplekv.methods import make_method
from ripplekv.methods.qfilter import filters as qfilters
from tests.conftest import invoke as run
from tests.conftest import tiny_llama


def numpy_filters(queries: list[np.ndarray], kv_heads: int) -> np.ndarray:
    """The filters [L, H_kv, d] by the recipe, from the queries themselves (per layer [H_q, N, d]): numpy's SVD of
    each query head's queries, its first right singular vector signed so their mean projection is positive, the
    mean over a KV head's query heads, stored negated (the published sign)."""
    out = []
    for layer in queries:
        directions = []
        for head in layer.astype(np.float64):
            v = np.linalg.svd(head, full_matrices=False)[2][0]
            directions.append(v if (head @ v).mean() >= 0 else -v)
        directions = np.asarray(directions)
        out.append(-directions.reshape(kv_heads, -1, directions.shape[-1]).mean(1))
    return np.asarray(out)


def test_the_direction_is_the_queries_principal_one_signed_by_their_mean_projection():
    generator = np.random.default_rng(0)
    axis = generator.standard_normal(12)
    axis /= np.linalg.norm(axis)
    queries = generator.standard_normal((500, 12)) + 4.0 * axis  # anisotropic: every query leans along `axis`
    direction, share = qfilters.signed_directions(queries.T @ queries, queries.sum(0))
    assert np.dot(direction, axis) > 0.98 and 0.5 < share < 1  # found, with the sign the queries take
    flipped, _ = qfilters.signed_directions(queries.T @ queries, -queries.sum(0))  # queries leaning the other way
    np.testing.assert_allclose(flipped, -direction)
    svd = np.linalg.svd(queries, full_matrices=False)[2][0]
    np.testing.assert_allclose(abs(np.dot(direction, svd)), 1.0, atol=1e-12)


def test_query_sums_are_every_post_rope_query_and_change_nothing_else():
    model = tiny_llama()
    ids = torch.randint(0, 101, (90,), generator=torch.Generator().manual_seed(0))
    plain = prefill_for(model, ids, Requirements())
    state = prefill_for(model, ids, Requirements(capture_window=90, signals={qfilters.QUERY_SUMS}))
    for layer, sums in enumerate(state.signal(qfilters.QUERY_SUMS)):
        queries = state.signal("window_queries")[layer].double()  # all 90 queries, post-RoPE, as attention saw them
        assert sums.count == 90
        torch.testing.assert_close(sums.total, queries.sum(1))
        torch.testing.assert_close(sums.gram, queries.transpose(1, 2) @ queries)
        assert torch.equal(state.keys[layer], plain.keys[layer]) and torch.equal(state.values[layer], plain.values[layer])


def tiny_filters(tmp_path, layers=4, heads=2, dim=16, seed=0, name="qfilter.safetensors"):
    drawn = np.random.default_rng(seed).standard_normal((layers, heads, dim))
    return qfilters.save(tmp_path / name, drawn, {"model": "tiny"})


def test_the_score_is_minus_the_keys_dot_product_with_the_filter_at_exact_budgets(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 101, (300,), generator=torch.Generator().manual_seed(1))
    weights = tiny_filters(tmp_path)
    methods = [make_method(s) for s in ("snapkv", f"qfilter:weights={weights}", f"qfilter:weights={weights}:window=0")]
    state = prefill_for(model, ids, Requirements.of_all(methods))
    filters = np.random.default_rng(0).standard_normal((4, 2, 16)).astype(np.float32)  # what tiny_filters saved
    for budget in (40, 128):
        assert [int(m.select(state, budget).sum()) for m in methods] == [4 * 2 * budget] * 3
        no_window, windowed = methods[2].select(state, budget), methods[1].select(state, budget)
        for layer in range(4):
            keys = state.keys[layer].numpy()  # [H, n, d]
            for head in range(2):
                scores = -(keys[head] @ filters[layer, head])
                top = set(np.argsort(-scores, kind="stable")[:budget].tolist())
                assert set(torch.nonzero(no_window[layer, head]).flatten().tolist()) == top
                prefix = set(np.argsort(-scores[:-32], kind="stable")[: budget - 32].tolist())
                assert set(torch.nonzero(windowed[layer, head]).flatten().tolist()) == prefix | set(range(268, 300))
    assert make_method(f"qfilter:weights={weights}").label == f"qfilter:weights={weights.name}"


def test_qfilter_without_fitted_filters_is_refused_in_one_line(tmp_path):
    state = prefill_for(tiny_llama(), list(range(1, 101)), Requirements())
    for spec, message in [("qfilter", "qfilter needs Q-filters fitted for this model; fit them on calibration prompts: "
                                      "ripplekv fit qfilter"),
                          (f"qfilter:weights={tiny_filters(tmp_path, layers=3, name='three.safetensors')}",
                           "was fitted for 3 layers x 2 KV heads x 16 head size; the model has 4 layers x 2 KV heads x 16"),
                          (f"qfilter:weights={tiny_filters(tmp_path, dim=8, name='narrow.safetensors')}",
                           "x 8 head size; the model has 4 layers x 2 KV heads x 16 head size")]:
        with pytest.raises(UserError, match=message) as refused:
            make_method(spec).select(state, 40)
        assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="do not exist; fit them on calibration prompts"):
        make_method(f"qfilter:weights={tmp_path / 'missing.safetensors'}")
    broken = tiny_filters(tmp_path, name="broken.safetensors")
    broken.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="do not load"):
        make_method(f"qfilter:weights={broken}")


def test_the_shipped_filters_are_where_qfilter_looks_and_fit_the_bundled_model():
    from ripplekv.methods.qfilter.method import shipped_filters

    filters, info = qfilters.load(shipped_filters())
    assert tuple(filters.shape) == (30, 3, 64) and info["model"] and info["calibration_ids"]
    assert torch.allclose(filters.norm(dim=-1), torch.ones(30, 3), atol=0.5)  # means of unit vectors, none vanished


def test_fit_qfilter_refuses_in_one_line_before_the_model(tmp_path, tiny_model_dir):
    result = run("fit", "qfilter", "--model", tiny_model_dir, "--out", tmp_path / "out", "--calib-samples", 0)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--calib-samples must be at least 1" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fit_qfilter_is_numpys_svd_of_the_calibration_queries_and_resumes(tmp_path, tiny_model_dir):
    from ripplekv.engine.models import load_model
    from ripplekv.tasks.calibration import Calibration

    out = tmp_path / "qfilter"
    args = ["fit", "qfilter", "--model", tiny_model_dir, "--calib-samples", 2, "--target-tokens", 300, "--device", "cpu",
            "--out", out]
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith(f"fit qfilter: writing to {out}\n") and f"wrote: {out / 'qfilter.safetensors'}" in first.stderr
    fitted, info = qfilters.load(out / "qfilter.safetensors")
    # independently: every query of the same prompts recorded as attention saw them, then numpy's SVD
    model, tokenizer, _ = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    prompts = Calibration(2, 300).prompts(tokenizer)
    recorded = []
    for prompt in prompts:
        ids = prompt.context + prompt.probe
        recorded.append(prefill_for(model, ids, Requirements(capture_window=len(ids))).signal("window_queries"))
    queries = [np.concatenate([r[layer].numpy() for r in recorded], axis=1) for layer in range(4)]
    np.testing.assert_allclose(fitted.numpy(), numpy_filters(queries, kv_heads=2), atol=2e-5)
    assert info["calibration_ids"] == [p.sample_id for p in prompts] and info["positions"] == queries[0].shape[1]
    assert {"calibration_hash", "collect_seconds", "fit_seconds", "model"} <= set(info)
    # resumed: the same command computes nothing again; after a kill between prompts only the missing one
    log = (out / "samples.jsonl").read_text()
    again = run(*args)
    assert again.returncode == 0 and (out / "samples.jsonl").read_text() == log, again.stderr
    lines = log.splitlines()
    kept_file = out / json.loads(lines[1])["value"]["sums"]
    before = kept_file.stat().st_mtime_ns
    (out / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n")  # the second prompt's line was never written
    (out / "qfilter.safetensors").unlink()
    resumed = run(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert kept_file.stat().st_mtime_ns == before and len((out / "samples.jsonl").read_text().splitlines()) == 3
    assert torch.equal(qfilters.load(out / "qfilter.safetensors")[0], fitted)
    other = run(*args[:-2], "--calib-draw", 1, "--calib-draws", 2, "--out", out)
    assert other.returncode == 2 and "use a new --out directory" in other.stderr  # another draw, another folder
