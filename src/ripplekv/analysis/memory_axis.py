"""The memory-axis table: at each budget (a number of bytes), every way of spending it side by side.

Eviction keeps fewer entries at full precision, a quantizer keeps every entry at fewer bits, key-channel pruning
(ThinK) keeps fewer channels of each key, and a method may combine them (`methods.core.quantized`). The table puts each variant's bytes (mean over samples,
and as a share of the budget's), entries and bits beside its KL to the full cache with the leaderboard's
interval and paired comparison, and its `n` (samples); a variant that did not fit its budget on some prompt is
listed as infeasible there, with no numbers, and one with fewer samples than the table's n is listed apart.

A threshold variant (`methods.core.thresholded`: what scores above tau, so a number of entries that varies per
prompt) is at no budget: it gets one row with no budget, at the bytes it spent (mean, and the range over samples
in `kv_bytes_min` / `kv_bytes_max`, which every row has), its KL and interval, never a ratio to a budget's
baseline, a verdict or a place in the figure, listed after the matched-byte rows. Written only when the run has a
quantized, key-channel-pruned or threshold variant.
"""

from __future__ import annotations

import pandas as pd

from ripplekv.analysis.over_budget import spends_by_threshold
from ripplekv.analysis.tables import fewer_samples
from ripplekv.runs.files import REFERENCE

FULL_PRECISION_BITS = 16
COLUMNS = ["budget", "method", "n", "fewer_samples", "bits", "entries", "kv_bytes", "bytes_share", "kl", "kl_ci_low",
           "kl_ci_high", "kl_ratio_vs_uniform", "kl_ratio_ci_low", "kl_ratio_ci_high", "kl_verdict", "infeasible",
           "kv_bytes_min", "kv_bytes_max", "threshold"]
COPIED = COLUMNS[8:15]  # from the leaderboard
AT_NO_BUDGET = COLUMNS[8:11]  # what a threshold row copies: its KL and interval (nothing judged against a budget)
HEADER = ["| budget | method | n | bits | entries | bytes (share) | KL [95% CI] | KL / baseline [95% CI] | verdict |",
          "|---|---|---|---|---|---|---|---|---|"]


def stored_otherwise(spec: dict) -> bool:
    """Whether a variant spends its bytes on something besides fewer full-precision entries."""
    return "quantizer" in spec or "key_channels" in spec


def bits_of(spec: dict) -> int | str:
    """The bits a variant stores its quantized entries at (16: full precision, no quantizer); `K4/V2` when keys
    and values differ, `profile` (with its average, if it evicts) when layers differ; `, keys x0.5 ch` when a
    share of each key's channels is pruned."""
    bits = _bits(spec)
    channels = spec.get("key_channels")
    return bits if channels is None else f"{bits}, keys x{1 - channels['ratio']:g} ch"


def _bits(spec: dict) -> int | str:
    quantizer = spec.get("quantizer", {})
    bits = quantizer.get("bits", FULL_PRECISION_BITS)
    if "key_bits" in quantizer:
        return f"K{quantizer['key_bits']}/V{quantizer['value_bits']}"
    if isinstance(bits, str):
        return bits + (f" (avg {quantizer['avgbits']:g})" if "avgbits" in quantizer else "")
    return int(bits)


def memory_table(frame: pd.DataFrame, board: pd.DataFrame, specs: dict,
                 refused: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """memory_axis.csv from the predictions (`frame`), the leaderboard, the run's resolved specs and the lines of
    variants that did not fit (`refused`); None when no variant is quantized."""
    def placed(spec) -> bool:
        return stored_otherwise(spec) or spends_by_threshold(spec)

    if not any(placed(spec) for spec in specs.values()) or "kv_bytes" not in frame.columns:
        return None
    lines = frame[frame["method"] != REFERENCE]
    by_threshold = {label for label, spec in specs.items() if spends_by_threshold(spec)}
    rows = []
    for (method, budget), group in lines.groupby(["method", "budget"], sort=False):
        threshold = method in by_threshold
        if threshold and budget != lines.loc[lines["method"] == method, "budget"].min():
            continue  # B plays no part: one row, from the lines at its smallest budget (every budget's are the same)
        row = {"budget": None if threshold else budget, "method": method, "bits": bits_of(specs.get(method, {})),
               "entries": group["kept_entries"].mean(), "kv_bytes": group["kv_bytes"].mean(),
               "kv_bytes_min": group["kv_bytes"].min(), "kv_bytes_max": group["kv_bytes"].max(), "threshold": threshold,
               "bytes_share": float("nan") if threshold or "kv_budget_bytes" not in group
               else (group["kv_bytes"] / group["kv_budget_bytes"]).mean(),
               "n": group[["task", "id"]].drop_duplicates().shape[0]}
        found = board[(board["method"] == method) & (board["budget"] == budget)]
        if len(found):
            row.update({name: found.iloc[0][name] for name in (AT_NO_BUDGET if threshold else COPIED)
                        if name in found.columns})
        rows.append(row)
    if refused is not None and len(refused):
        for (method, budget), group in refused.groupby(["method", "budget"], sort=False):
            rows.append({"budget": budget, "method": method, "bits": bits_of(specs.get(method, {})),
                         "infeasible": f"{len(group)} samples: {group['infeasible'].iloc[0]}"})
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    table["budget"] = table["budget"].astype("Int64")
    table["n"] = table["n"].astype("Int64")
    table["threshold"] = table["threshold"].fillna(False).astype(bool)
    table["fewer_samples"] = fewer_samples(table["n"]) & table["infeasible"].isna()
    # Within a budget: the rows on the table's n by KL, then those with fewer samples (never ranked among them);
    # the threshold rows (no budget) last.
    return table.sort_values(["budget", "fewer_samples", "kl"], kind="stable", na_position="last").reset_index(drop=True)


def memory_markdown(table: pd.DataFrame) -> str:
    """The table as markdown: per budget, each variant's bytes (share of the budget), entries, bits and KL [95% CI]."""
    threshold = table["threshold"].astype(bool) if "threshold" in table else table["method"].isna()
    at_no_budget, table = table[threshold], table[~threshold]
    lines = ["## Memory axis: eviction, quantization, key channels and their mixes at matched bytes", "",
             "Budget B is the bytes of B full-precision K/V entries per layer and KV head; each variant spends at "
             "most that (bytes: mean over samples; share: of the budget's). Quantized entries are dequantized "
             "before attention: memory is accounted, not saved, on this engine.", "",
             *HEADER]
    apart = table["fewer_samples"].astype(bool)
    lines += [_memory_line(row) for row in table[~apart].itertuples(index=False)]
    if apart.any():
        lines += ["", f"Rows with fewer samples than the table's n ({int(table['n'].max())}), not ranked:", "",
                  *HEADER, *(_memory_line(row) for row in table[apart].itertuples(index=False))]
    if len(at_no_budget):
        lines += ["", "Threshold variants: each keeps what scores above its threshold, so its memory varies per prompt "
                  "and it is at no budget: placed at the bytes it spent (mean over samples, [min, max]) beside the "
                  "rows above, never ranked or judged against them.", "",
                  "| method | n | entries | bytes mean [min, max] | KL [95% CI] |", "|---|---|---|---|---|",
                  *(_threshold_line(row) for row in at_no_budget.itertuples(index=False))]
    return "\n".join(lines) + "\n"


def _threshold_line(row) -> str:
    """A threshold variant's markdown row: what it spent, and its KL."""
    interval = "" if pd.isna(row.kl_ci_low) else f" [{row.kl_ci_low:.3g}, {row.kl_ci_high:.3g}]"
    kl = "" if pd.isna(row.kl) else f"{row.kl:.4g}{interval}"
    return (f"| {row.method} | {row.n} | {row.entries:.0f} | {row.kv_bytes:.0f} [{row.kv_bytes_min:.0f}, "
            f"{row.kv_bytes_max:.0f}] | {kl} |")


def _memory_line(row) -> str:
    """One variant's markdown row: infeasible, or its numbers."""
    if isinstance(row.infeasible, str):
        return f"| {row.budget} | {row.method} | | {row.bits} | | infeasible ({row.infeasible}) | | | |"
    ratio = "" if pd.isna(row.kl_ratio_vs_uniform) else f"{row.kl_ratio_vs_uniform:.3g}" + (
        "" if pd.isna(row.kl_ratio_ci_low) else f" [{row.kl_ratio_ci_low:.3g}, {row.kl_ratio_ci_high:.3g}]")
    interval = "" if pd.isna(row.kl_ci_low) else f" [{row.kl_ci_low:.3g}, {row.kl_ci_high:.3g}]"
    verdict = "" if pd.isna(row.kl_verdict) else row.kl_verdict
    return (f"| {row.budget} | {row.method} | {row.n} | {row.bits} | {row.entries:.0f} | {row.kv_bytes:.0f} "
            f"({row.bytes_share:.3f}) | {row.kl:.4g}{interval} | {ratio} | {verdict} |")


def plot_memory_axis(table: pd.DataFrame, path, styles=None) -> None:
    """memory_axis.png: each variant's KL as a multiple of the uniform baseline's at the same budget (log axis,
    95% CI of the ratio) against the bytes it keeps (linear MiB), one line per method across the budgets, so
    the ways of spending the same memory sit at the same x and the lowest line is the front. A ratio, not the
    KL itself: at a few samples the KL's own t interval reaches 0, which a log axis cannot show honestly. Rows
    with fewer samples than the table's n are left out (the table lists them apart)."""
    from matplotlib.ticker import FuncFormatter

    from ripplekv.analysis.plots import pyplot, series_styles
    from ripplekv.runs.safeio import save_figure

    plt = pyplot()
    drawn = table[table["infeasible"].isna() & table["kl_ratio_vs_uniform"].notna() & ~table["fewer_samples"].astype(bool)]
    styles = styles or series_styles(drawn["method"])
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    for method, group in drawn.groupby("method", sort=False):
        group = group.sort_values("kv_bytes")
        value = group["kl_ratio_vs_uniform"].astype(float)
        low, high = group["kl_ratio_ci_low"].astype(float), group["kl_ratio_ci_high"].astype(float)
        style = styles[method]
        ax.errorbar(group["kv_bytes"] / 2**20, value, yerr=[(value - low).clip(lower=0), (high - value).clip(lower=0)],
                    marker=style.marker, linestyle=style.line, capsize=3, color=style.colour,
                    markerfacecolor=style.face, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.set_xlabel("KV cache bytes kept per prompt (MiB, mean over samples)")
    ax.set_ylabel("KL / the uniform baseline's KL at the same budget\n(log; 95% CI; below 1: closer to the full cache)")
    ax.set_title("Fidelity vs memory: eviction, quantization and both")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
