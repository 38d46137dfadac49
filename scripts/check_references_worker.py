"""check-references' reference side (runs in the reference venv: kvpress 0.5.5, transformers 5.2.0, no ripplekv).

Three passes over each prompt with the bundled model's dequantized weights, each press's own code deciding:
- eager: a hook on every attention layer calls each scorer press's `compress` on the layer's keys with the
  values replaced by their positions, so the "values" it returns are the positions it kept; its `score` is
  redirected to the real values (Expected Attention and CriticalKV weigh by them). The hook leaves the cache
  alone. It also records what the rules re-implemented on our side read (SnapKV scores, CAKE's and the
  allocators' signals, key norms and each scorer's scores to tell tied entries apart).
- sdpa: KVzapPress holding our surrogate and QFilterPress our filters for the bundled model
  (`check_references_learned`, `check_references_qfilter`), not the hub's,
  its `compress` as in the eager hook (sdpa is what our prefill runs, so the hidden states are ours), and
  DMSPress over it (KVzap's threshold mode) through its own forward hook, kept = what it left unmasked; and the
  presses that hide entries behind masks and refuse eager attention (AdaKV, CriticalAdaKV, LU-KV with our
  curve set on it) run their `compress` in the same kind of hook; kept = every position not in the press's
  `masked_key_indices`.
- KVzip: `KVzipPress` as kvpress runs it (prefill under the press, then its own chunked reconstruction pass
  through the cache), its final selection (`compress_post`) made once per budget from the one scoring.
FinchPress (its window from our side's question split), SimLayerKVPress and KVgradPress as
`check_references_special` says; FastKVzipPress holding our gates as `check_references_learned` says.
Kept sets are written as `[H, most kept]` position arrays padded with -1, one per (press, budget, layer).
Last, optimum-quanto quantize-dequantizes the K/V our side saved (`check_references_quant`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

WINDOW = 32  # SnapKV's observation window, CAKE's window
SEEDED = ("leverage", "compactor")  # presses that draw a random sketch, or blend at the compression ratio (`seeded`)
KERNEL = 5  # kvpress's SnapKV pools with avg_pool1d; ours is asked for the same


def padded(rows: list[np.ndarray]) -> np.ndarray:
    """Kept positions per head, sorted, padded with -1 to the longest head."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for head, row in enumerate(rows):
        out[head, : len(row)] = np.sort(row)
    return out


def kept_by_compress(press, module, hidden, keys, values, attentions, kwargs) -> np.ndarray:
    """The positions a scorer press's own `compress` keeps: positions in place of the values, its score on the real ones."""
    import torch

    n = keys.shape[2]
    positions = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand_as(values).contiguous()
    score = press.score
    press.score = lambda m, h, k, v, a, kw: score(m, h, k, values, a, kw)
    try:
        _, kept = press.compress(module, hidden, keys, positions, attentions, kwargs)
    finally:
        del press.score
    return padded(list(kept[0, :, :, 0].round().long().numpy()))


def kept_by_mask(module, heads: int, n: int) -> np.ndarray:
    """Every position a masking press left out of `module.masked_key_indices` (then cleared), per head."""
    masked = getattr(module, "masked_key_indices", None)
    keep = np.ones((heads, n), dtype=bool)
    if masked is not None:
        keep[masked[1].cpu().numpy(), masked[2].cpu().numpy()] = False
    module.masked_key_indices = None
    return padded([np.flatnonzero(row) for row in keep])


def build_presses(model, curve_path: Path | None, out: Path):
    """(eager presses, sdpa presses): each name the comparison reads, configured as its pair on our side."""
    from check_references_chunks import chunk_presses
    from check_references_learned import kvzap_presses
    from check_references_qfilter import qfilter_presses
    from kvpress import (
        AdaKVPress,
        CriticalAdaKVPress,
        CriticalKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        LUKVPress,
        ObservedAttentionPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    def snap():
        return SnapKVPress(window_size=WINDOW, kernel_size=KERNEL)

    eager = {"snapkv": snap(), "streamingllm": StreamingLLMPress(n_sink=4), "tova": TOVAPress(), "knorm": KnormPress(),
             "observed": ObservedAttentionPress(), "expected": ExpectedAttentionPress(), "keydiff": KeyDiffPress(),
             "criticalkv": CriticalKVPress(snap()), "pyramidkv": PyramidKVPress(window_size=WINDOW, kernel_size=KERNEL),
             **scorer_presses()}
    sdpa = {"adakvpress": AdaKVPress(snap()), "criticaladakv": CriticalAdaKVPress(snap())}
    eager.update(chunk_presses())  # ChunkKV, its entropy gate, ChunkPress, LagKV (check_references_chunks)
    if curve_path is not None:
        lukv = LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1)
        lukv._budget_curves = np.load(curve_path)  # our curve, in place of the one it would download
        sdpa["lukv"] = lukv
    for press in [*eager.values(), *sdpa.values()]:
        if not isinstance(press, LUKVPress):
            press.post_init_from_model(model)
    # our surrogates set on KVzapPress (its own init would download the hub's); scored under sdpa, the attention our
    # prefill runs, so the hidden states they read are the same numbers on both sides
    sdpa.update(kvzap_presses(out))
    sdpa.update(qfilter_presses(out))  # our fitted filters set on QFilterPress (its init would download the hub's)
    from check_references_learned import duo_press

    duo = duo_press(out)  # our gates' order (its own init would download a hub pattern)
    if duo is not None:
        sdpa["duoattention"] = duo
    return eager, sdpa


def scorer_presses() -> dict:
    """kvpress 0.5.5's training-free scorer presses added by issue 63, at their defaults."""
    import kvpress

    return {"leverage": kvpress.LeverageScorePress(), "noncausal": kvpress.NonCausalAttnPress(),
            "compactor": kvpress.CompactorPress(), "cur": kvpress.CURPress(), "capkv": kvpress.CapPress()}


def ratio(name: str, budget: int, n: int, entries: int) -> float:
    """The compression_ratio at which press `name` keeps `budget` entries per head of an `n`-token prompt (KVzip:
    `entries` = L x H_kv x n over the whole cache): each press turns the ratio into counts its own way."""
    from check_references_chunks import chunk_ratio

    if chunk_ratio(name, budget, n) is not None:
        return chunk_ratio(name, budget, n)
    if name in ("lukv", "pyramidkv"):
        return 1 - budget / n  # LU-KV reads its curve's row at the ratio; PyramidKV's layers average B
    if name in ("kvzip", "kvgrad", "fastkvzip"):
        return 1 - (entries * budget / n - 0.5) / entries  # int(entries x ratio) prunes all but L x H x B
    return 1 - (budget + 0.5) / n  # int(n x (1 - ratio)) == budget


def worker(args) -> None:
    from importlib import metadata

    import kvpress
    import torch
    import transformers
    from check_references_allocators import signals as allocator_signals
    from check_references_axes import reference_axes
    from check_references_quant import reference_dequantized
    from check_references_special import questions, special_presses
    from kvpress import KVgradPress, KVzipPress
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb  # as a press's context manager sets it
    out = Path(args.out)
    curve = out / "lukv_curve.npy"
    eager, sdpa = build_presses(model, curve if curve.exists() else None, out)
    wanted = set(args.keys.split(",")) if args.keys else None  # --only: the reference keys of the pairs asked for
    if wanted is not None:
        eager = {name: press for name, press in eager.items() if name in wanted}
        sdpa = {name: press for name, press in sdpa.items() if name in wanted}
    special = special_presses(wanted if wanted is not None else {"finch", "simlayerkv", "kvgrad"})
    if "finch" in special:
        eager["finch"] = special.pop("finch")
        eager["finch"].post_init_from_model(model)
    cuts = questions(out)
    budgets = [int(b) for b in args.budgets.split(",")]
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for ids_path in sorted(out.glob("prompt_*.npy")):
        index = int(ids_path.stem.split("_")[1])
        ids = torch.as_tensor(np.load(ids_path), dtype=torch.long)[None]
        if "finch" in eager:  # what its delimiter hook would set: the question part, as our side cut it
            eager["finch"].window_size = ids.shape[1] - cuts[ids_path.stem]
        record = hooked_passes(model, ids, eager, sdpa, budgets, heads, allocator_signals, DynamicCache, special)
        for name, press_class in (("kvzip", KVzipPress), ("kvgrad", KVgradPress)):
            if wanted is None or name in wanted:
                record.update(kvzip_kept(model, ids, budgets, layers, heads, press_class, DynamicCache, name))
        if (out / "fastkvzip.safetensors").is_file() and (wanted is None or "fastkvzip" in wanted):
            from check_references_learned import fastkvzip_kept

            record.update(fastkvzip_kept(model, ids, budgets, heads, out, kept_by_mask, ratio, DynamicCache))
        if wanted is None or "kvcompose" in wanted:
            record.update(kvcompose_kept(model, ids, budgets, layers, DynamicCache))
        np.savez_compressed(out / f"reference_{ids_path.stem}.npz", **record)
        if (out / f"axes_ours_{index}.npz").exists():  # think, merge, rerotate: a pass of their own
            reference_axes(model, ids, out, index)
        print(f"reference: {ids_path.stem} ({ids.shape[1]} tokens) done", file=sys.stderr)
    model.set_attn_implementation("eager")
    if wanted is None:
        reference_dequantized(out)  # optimum-quanto's quantize-dequantize of our prefill's K/V (check_references_quant)
    (out / "reference_versions.json").write_text(json.dumps(
        {"kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": transformers.__version__,
         "torch": torch.__version__, "optimum-quanto": metadata.version("optimum-quanto")}))


def kvcompose_kept(model, ids, budgets, layers, DynamicCache) -> dict[str, np.ndarray]:
    """KVComposePress's kept sets at every budget, as it runs (prefill, then the prompt read again through the cache
    under eager attention): its masks made once per budget from the one reading, before it compresses the cache."""
    import kvpress
    import torch

    n = ids.shape[1]
    record = {}
    press = kvpress.KVComposePress()
    own_compress = press.compress_cache

    def every_budget(model_):
        for budget in budgets:
            press.compression_ratio = 1 - (layers * budget + 0.5) / (layers * n)  # int(L n (1 - ratio)) == L x B
            press.prepare_important_masks()
            for layer in range(layers):
                masks = press.important_mask_per_kv_head[layer]
                record[f"kvcompose/{budget}/{layer}"] = padded([np.flatnonzero(mask.cpu().numpy()) for mask in masks])
        own_compress(model_)

    press.compress_cache = every_budget
    with torch.no_grad(), press(model):
        model(ids, past_key_values=DynamicCache(config=model.config))
    return record


def kvzip_kept(model, ids, budgets, layers, heads, KVzipPress, DynamicCache, name="kvzip") -> dict[str, np.ndarray]:
    """KVzipPress's kept sets at every budget from its one reconstruction pass (under sdpa, as it requires), and
    its scores (to tell tied entries apart); `KVzipPress` may be its subclass KVgradPress (`name` kvgrad)."""
    import torch

    n = ids.shape[1]
    record = {}
    press = KVzipPress()
    own_post = press.compress_post

    def every_budget(model_):
        for budget in budgets:
            press.compression_ratio = ratio(name, budget, n, layers * heads * n)
            own_post(model_)
            for layer in model_.model.layers:
                record[f"{name}/{budget}/{layer.self_attn.layer_idx}"] = kept_by_mask(layer.self_attn, heads, n)
        for layer in range(layers):
            record[f"{name}_scores/{layer}"] = press.score_val[layer, 0].float().detach().numpy()

    press.compress_post = every_budget
    press.compression_ratio = ratio(name, budgets[0], n, layers * heads * n)
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    return record


def seeded(press, name: str, budget: int, n: int, layer: int) -> None:
    """Set what our side fixes where kvpress leaves it open: the global generator seeded with 0 + layer, from which
    our side draws layer `layer`'s Gaussian sketch (kvpress draws from it unseeded); Compactor's blending at
    1 - B / n, the compression ratio our side blends at (kvpress's default is its ratio, here 1 - (B + 0.5) / n)."""
    import torch

    torch.manual_seed(layer)
    if name == "compactor":
        press.blending = 1 - budget / n


def forward_with_hook(model, ids, hook, implementation: str, DynamicCache) -> None:
    """One forward of `ids` under `implementation` ("eager", "sdpa") with `hook` on every attention layer (kwargs
    passed), the hooks removed after."""
    import torch

    model.set_attn_implementation(implementation)
    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, past_key_values=DynamicCache(config=model.config))
    finally:
        for handle in hooks:
            handle.remove()


def hooked_passes(model, ids, eager, sdpa, budgets, heads, allocator_signals, DynamicCache,
                  special=None) -> dict[str, np.ndarray]:
    """One eager forward (the scorer presses, the signals the rules re-implemented on our side read) and one sdpa
    forward (the masking presses) over the prompt `ids`, each press choosing in a hook on every attention layer."""
    import torch
    from check_references_chunks import chunk_scores, kept_by_chunk_press
    from check_references_learned import THRESHOLD_KEYS, duo_kept
    from check_references_special import simlayerkv_kept

    n = ids.shape[1]
    record: dict[str, np.ndarray] = {}
    prefs = {}

    def eager_hook(module, inputs, kwargs, output):
        layer = module.layer_idx
        cache_layer = kwargs["past_key_values"].layers[layer]
        keys, values, hidden = cache_layer.keys, cache_layer.values, kwargs["hidden_states"]
        attentions = output[1]
        for name, press in eager.items():
            for budget in budgets:
                press.compression_ratio = ratio(name, budget, n, 0)
                if name in SEEDED:
                    seeded(press, name, budget, n, layer)
                record[f"{name}/{budget}/{layer}"] = kept_by_chunk_press(name, press, module, hidden, keys, values,
                                                                         attentions, kwargs)
        record.update(chunk_scores(eager, module, hidden, keys, values, kwargs, layer))
        record[f"knorm_scores/{layer}"] = -keys[0].float().norm(dim=-1).numpy()  # [H, n]: to tell ties apart
        for name in ("expected", "keydiff", "finch", "leverage"):  # leverage: layer 0's repeated tokens tie exactly
            if name in eager:
                if name in SEEDED:
                    seeded(eager[name], name, budgets[0], n, layer)  # the sketch its `compress` drew
                record[f"{name}_scores/{layer}"] = eager[name].score(module, hidden, keys, values, attentions, kwargs)[0].float().numpy()
        if "snapkv" in eager:
            snap = eager["snapkv"].score(module, hidden, keys, values, attentions, kwargs)
            record[f"snapkv_scores/{layer}"] = snap[0, :, : n - WINDOW].float().numpy()
        if special and "simlayerkv" in special:  # one kept set per layer, whatever the budget
            kept = simlayerkv_kept(special["simlayerkv"], module, hidden, keys, attentions, kwargs, padded)
            record.update({f"simlayerkv/{budget}/{layer}": kept for budget in budgets})
        window = attentions[0, :, -WINDOW:, : n - WINDOW].float()
        entropy = float(-(window * torch.log(window + 1e-10)).sum())  # cakekv's calculate_entropy
        variance = float(torch.var(window, dim=-2).sum())
        prefs[layer] = (entropy, variance)
        record.update(allocator_signals(layer, attentions, values, n))  # DynamicKV's and LAVa's
        return output

    def sdpa_hook(module, inputs, kwargs, output):
        layer = module.layer_idx
        cache_layer = kwargs["past_key_values"].layers[layer]
        keys, values, hidden = cache_layer.keys, cache_layer.values, kwargs["hidden_states"]
        for name, press in sdpa.items():
            if name == "duoattention":  # its streaming mask per budget (check_references_learned.duo_kept)
                kept = duo_kept(press, model, module, hidden, keys, values, kwargs, budgets, heads)
                record.update({f"{name}/{budget}/{layer}": kept[budget] for budget in budgets})
                continue
            if name in THRESHOLD_KEYS:  # DMSPress: its own forward hook masks what scores below tau, whatever B
                module.masked_key_indices = None
                press.forward_hook(module, inputs, kwargs, output)
                kept = kept_by_mask(module, heads, n)
                record.update({f"{name}/{budget}/{layer}": kept for budget in budgets})
                continue
            scorer = name.startswith(("kvzap", "qfilter"))  # a scorer press (top-k), not a masking one
            for budget in budgets:
                press.compression_ratio = ratio(name, budget, n, 0)
                if scorer:
                    record[f"{name}/{budget}/{layer}"] = kept_by_compress(press, module, hidden, keys, values, None, kwargs)
                    continue
                press.compress(module, hidden, keys, values, None, kwargs)
                record[f"{name}/{budget}/{layer}"] = kept_by_mask(module, heads, n)
            if scorer:
                record[f"{name}_scores/{layer}"] = press.score(module, hidden, keys, values, None, kwargs)[0].float().numpy()
        if "lukv" in sdpa:
            scores = sdpa["lukv"].press.score(module, hidden, keys, values, None, kwargs)
            record[f"lukv_scores/{layer}"] = scores[0].float().numpy()
        return output

    for implementation, hook in (("eager", eager_hook), ("sdpa", sdpa_hook)):
        forward_with_hook(model, ids, hook, implementation, DynamicCache)
    record["cake_prefs"] = np.asarray([prefs[layer] for layer in range(len(prefs))], dtype=np.float64)
    return record
