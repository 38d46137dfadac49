"""check-references' learned parts: what the presses that download trained artefacts are given instead (ours).

kvpress's `LUKVPress` reads a budget curve and `KVzapPress` a surrogate from the hub, both trained for 8B
models; here each gets the one we profiled or fitted for the bundled model on calibration prompts
(`src/ripplekv/data/lukv/`, `src/ripplekv/data/kvzap/`), copied into the run folder for the worker (which
imports no ripplekv). A method whose artefact is not shipped is left out of the check, with one line saying so.
KVzap's threshold mode is `DMSPress` over `KVzapPress` holding our MLP surrogate (its own forward hook in the
worker's sdpa pass, at its default sliding window of 128), against `kvzap:threshold=TAU:window=128`.
`DuoAttentionPress` is given our fitted gates (`src/ripplekv/data/duoattention/`) through the head pattern its
`post_init_from_model` loads, and per prompt and budget the head_compression_ratio (n - B) / (n - w) that our side
maps B to, against `duoattention:rounding=kvpress`. The press only orders the gates (an argsort, which leaves ties
unspecified), so it gets their order as distinct values in (0, 1): ties fall as ours do (earlier layer, then head).
`FastKVzipPress` holds our gates for the bundled model (`src/ripplekv/data/fastkvzip/`) in place of the hub's and
runs as kvpress runs it (its hooks score during the prefill under sdpa, `compress_post` selects), once per budget.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

SHIPPED_CURVE = "lukv"  # the bundled model's LU-KV curve (Expected Attention, epsilon 0.02) that LUKVPress is given
# check name -> (our spec reproducing the press, the worker's press key, the surrogate kind it loads)
KVZAP_PAIRS = {"kvzap": ("kvzap:window=0", "kvzap", "mlp"),
               "kvzap:model=linear": ("kvzap:model=linear:window=0", "kvzap-linear", "linear")}
# KVzap's threshold mode: tau in our surrogate's log-score units (-5 keeps about 40% of a 1k-token offline prompt's
# entries with the shipped MLP), and DMSPress's default sliding window; check name -> (our spec, worker key)
DMS_TAU, DMS_WINDOW = -5.0, 128
THRESHOLD_PAIRS = {f"kvzap:threshold={DMS_TAU:g}": (f"kvzap:threshold={DMS_TAU:g}:window={DMS_WINDOW}", "kvzap-dms")}
THRESHOLD_KEYS = {key for _, key in THRESHOLD_PAIRS.values()}
DUO_PAIRS = {"duoattention:rounding=kvpress": ("duoattention:rounding=kvpress", "duoattention")}
DUO_FILE = "duoattention_pattern.json"  # what the worker sets on DuoAttentionPress: the gates' order and the window
# FastKVzipPress at its defaults (non-layerwise, 4 sinks, a window of 2% of the prompt) holding our gates
FASTKVZIP_PAIRS = {"fastkvzip": ("fastkvzip:granularity=entry:window=0:window_ratio=0.02", "fastkvzip")}


def shipped_curve(out: Path) -> bool:
    """Our LU-KV curve for the bundled model, saved for the worker to set on LUKVPress; False when none is shipped."""
    from ripplekv.engine.models import DEFAULT_MODEL
    from ripplekv.methods.lukv.method import SHIPPED, read_curve

    path = SHIPPED / f"{DEFAULT_MODEL}-{SHIPPED_CURVE}.csv"
    if not path.is_file():
        return False
    np.save(out / "lukv_curve.npy", read_curve(path)[0])
    return True


def shipped_surrogates(out: Path) -> list[str]:
    """The check names of the KVzap surrogates shipped for the bundled model, each copied (weights + shapes) into
    `out` as `KEY.safetensors` / `KEY.json` for the worker to load into kvpress's `KVzapModel`."""
    from ripplekv.methods.kvzap.method import shipped_weights

    found = []
    for name, (_, key, kind) in KVZAP_PAIRS.items():
        path = shipped_weights(kind)
        if path.is_file() and path.with_suffix(".json").is_file():
            shutil.copyfile(path, out / f"{key}.safetensors")
            shutil.copyfile(path.with_suffix(".json"), out / f"{key}.json")
            found.append(name)
    return found + (list(THRESHOLD_PAIRS) if "kvzap" in found else [])  # DMSPress wraps the MLP one


def shipped_duo_gates(out: Path) -> list[str]:
    """The DuoAttention pair when gates are shipped for the bundled model: their order (as distinct values) and
    window saved in `out` for the worker; [] when none are shipped."""
    from ripplekv.methods.duoattention.gates import read_gates, shipped_gates

    if not shipped_gates().is_file():
        return []
    read = read_gates(shipped_gates())
    gates = np.asarray(read["gates"], dtype=np.float64)
    ranks = np.argsort(np.argsort(gates.reshape(-1), kind="stable"), kind="stable").reshape(gates.shape)
    (out / DUO_FILE).write_text(json.dumps({"sinks": read["sinks"], "recent": read["recent"],
                                            "order": ((ranks + 1) / (ranks.size + 1)).tolist()}))
    return list(DUO_PAIRS)


def duo_note(ours_files, name: str, budgets: list[int]) -> str:
    """How far kvpress's counts (whole prompt or the window per head) move the total from L x H x B."""
    drifts = []
    for path in ours_files:
        ours = np.load(path)
        drifts += [ours[f"{name}/{b}/counts"].mean() / b - 1 for b in budgets]
    return (f"; kvpress's head counts keep {min(drifts):+.2%} to {max(drifts):+.2%} of L x H x B "
            f"(`duoattention`, exact, keeps it)")


def duo_press(out: Path):
    """(worker side) kvpress's `DuoAttentionPress` holding our gates' order from `out` in place of the hub pattern
    its `post_init_from_model` would download; None without them."""
    path = out / DUO_FILE
    if not path.is_file():
        return None
    from kvpress import DuoAttentionPress

    pattern = json.loads(path.read_text())
    press = DuoAttentionPress()
    press.load_attention_pattern = lambda model: (pattern["sinks"], pattern["recent"], np.asarray(pattern["order"]))
    return press


def duo_kept(press, model, module, hidden, keys, values, kwargs, budgets, heads) -> dict[int, np.ndarray]:
    """(worker side) The press's kept sets of one layer at each budget: its head_compression_ratio set to the share of
    heads that stream at B, its streaming mask rebuilt by its own code, then its `compress` (kept = left unmasked)."""
    from check_references_worker import kept_by_mask

    n = keys.shape[2]
    sinks, recent, _ = press.load_attention_pattern(model)
    window, kept = sinks + recent, {}
    for budget in budgets:
        press.head_compression_ratio = 0.0 if budget >= n else (1.0 if n <= window else min(1.0, (n - budget) / (n - window)))
        press.post_init_from_model(model)
        module.masked_key_indices = None
        press.compress(module, hidden, keys, values, None, kwargs)
        kept[budget] = kept_by_mask(module, heads, n)
    return kept


def shipped_gates(out: Path) -> list[str]:
    """["fastkvzip"] when the bundled model's gates are shipped, copied into `out` as fastkvzip.safetensors / .json
    for the worker to load into kvpress's `FastKVzipGate`; [] otherwise."""
    from ripplekv.methods.fastkvzip.method import shipped_gates as shipped

    path = shipped()
    if not (path.is_file() and path.with_suffix(".json").is_file()):
        return []
    shutil.copyfile(path, out / "fastkvzip.safetensors")
    shutil.copyfile(path.with_suffix(".json"), out / "fastkvzip.json")
    return list(FASTKVZIP_PAIRS)


def missing_lines(has_curve: bool, surrogates: list[str], duo: list[str] = ()) -> list[str]:
    """One line per learned method the check leaves out because its artefact is not shipped."""
    lines = [] if has_curve else ["lukv: no curve shipped for the bundled model (src/ripplekv/data/lukv/), so LUKVPress "
                                  "is not checked"]
    lines += [] if duo else ["duoattention: no gates shipped for the bundled model (src/ripplekv/data/duoattention/), "
                             "so DuoAttentionPress is not checked"]
    lines += [f"{name}: no surrogate shipped for the bundled model (src/ripplekv/data/kvzap/), so KVzapPress is not "
              "checked" for name in KVZAP_PAIRS if name not in surrogates]
    lines += [f"{name}: no gates shipped for the bundled model (src/ripplekv/data/fastkvzip/), so FastKVzipPress is not "
              "checked" for name in FASTKVZIP_PAIRS if name not in surrogates]
    return lines


def lukv_drift(ours_files, layers: int, budgets: list[int]) -> str:
    """How far kvpress's rounding of our curve (its nearest-percent row, per-layer rounding) moves the total from
    L x H x B, over the prompts and budgets: ours keeps L x H x B exactly."""
    from ripplekv.engine.models import DEFAULT_MODEL
    from ripplekv.methods.lukv.method import SHIPPED, kvpress_counts, read_curve

    curve = read_curve(SHIPPED / f"{DEFAULT_MODEL}-{SHIPPED_CURVE}.csv")[0]
    drifts = [kvpress_counts(curve, b, int(json.loads(str(np.load(p)["meta"]))["tokens"])).mean() / b - 1
              for p in ours_files for b in budgets]
    return (f"; kvpress's rounding of the curve keeps {min(drifts):+.2%} to {max(drifts):+.2%} of L x H x B "
            f"(`lukv`, exact, keeps it)")


def threshold_note(ours_files, name: str, budget: int) -> str:
    """The share of each prompt's entries a threshold pair kept (whatever the budget: B plays no part)."""
    shares = []
    for path in ours_files:
        ours = np.load(path)
        counts = ours[f"{name}/{budget}/counts"]
        shares.append(float(counts.sum()) / (counts.size * int(json.loads(str(ours["meta"]))["tokens"])))
    return f"; kept {', '.join(f'{s:.1%}' for s in shares)} of each prompt's entries (one kept set whatever B)"


def kvzap_presses(out: Path) -> dict:
    """(worker side, reference venv) worker key -> kvpress `KVzapPress` holding our surrogate from `out`, in place
    of the hub model its `post_init_from_model` would download."""
    import torch
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel, KVzapPress
    from safetensors.torch import load_file

    presses = {}
    for _, key, kind in KVZAP_PAIRS.values():
        path = out / f"{key}.safetensors"
        if not path.is_file():
            continue
        info = json.loads((out / f"{key}.json").read_text())
        config = KVzapConfig(input_dim=info["input_dim"], output_dim=info["output_dim"], hidden_dim=info["hidden_dim"],
                             n_modules=info["n_modules"])
        surrogate = KVzapModel(config)
        surrogate.load_state_dict({name: value.to(torch.float32) for name, value in load_file(str(path)).items()})
        press = KVzapPress(model_type=kind)
        press.kvzap_model = surrogate.eval()
        presses[key] = press
    if "kvzap" in presses:
        from kvpress import DMSPress

        scorer = KVzapPress(model_type="mlp")
        scorer.kvzap_model = presses["kvzap"].kvzap_model
        for key in THRESHOLD_KEYS:
            presses[key] = DMSPress(scorer, threshold=DMS_TAU, sliding_window_size=DMS_WINDOW)
    return presses


def fastkvzip_kept(model, ids, budgets, heads, out: Path, kept_by_mask, ratio, DynamicCache) -> dict[str, np.ndarray]:
    """(worker side) `FastKVzipPress` holding our gates from `out`: its hooks score each layer's attention input during
    one sdpa prefill under the press, its `compress_post` selects once per budget from those scores; its kept sets
    and its scores (to tell tied entries apart)."""
    import torch
    from kvpress.presses.fastkvzip_press import FastKVzipGate, FastKVzipPress
    from safetensors.torch import load_file

    info = json.loads((out / "fastkvzip.json").read_text())
    tensors = load_file(str(out / "fastkvzip.safetensors"))
    gates = []
    for layer in range(info["n_modules"]):
        gate = FastKVzipGate(layer, info["input_dim"], info["heads"], info["group"], torch.float32, info["dim"],
                             info["sinks"])
        prefix = f"layers.{layer}."
        gate.load_state_dict({k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)})
        gates.append(gate.eval())
    n, record = ids.shape[1], {}
    press = FastKVzipPress()
    press.gates = gates  # ours, in place of the hub's its `post_init_from_model` would download
    own_post = press.compress_post

    def every_budget(model_):
        scored = list(press.score_val)  # per layer; its `compress_post` stacks them in place
        for budget in budgets:
            press.compression_ratio = ratio("fastkvzip", budget, n, len(gates) * heads * n)
            press.score_val = list(scored)
            own_post(model_)
            for layer in model_.model.layers:
                record[f"fastkvzip/{budget}/{layer.self_attn.layer_idx}"] = kept_by_mask(layer.self_attn, heads, n)
        for layer in range(len(gates)):
            record[f"fastkvzip_scores/{layer}"] = press.score_val[layer, 0].float().detach().numpy()

    press.compress_post = every_budget
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    return record
