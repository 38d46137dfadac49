"""The study's page: what it measured, its design fixed in advance, a verdict traceable to table rows.

Every sentence of the verdict paragraph is built from one row of a table on the same page and names it by its
id (`P-128` for the primary comparison at B=128, `F-128-3` for the factorial table's third row there), so a
reader can check each claim where its interval and p-value stand.
"""

from __future__ import annotations

import pandas as pd

from ripplekv.analysis import inference

PRIMARY_COLUMNS = ["id", "budget", "comparison", "samples", "delta", "ci_low", "ci_high", "detectable", "p",
                   "p_holm", "verdict"]


def with_ids(effects: pd.DataFrame) -> pd.DataFrame:
    """The factorial table with a row id per budget (`F-B-i`, i from 1 in table order)."""
    effects = effects.copy()
    effects.insert(0, "id", [f"F-{b}-{i + 1}" for b, group in effects.groupby("budget", sort=False)
                             for i in range(len(group))])
    return effects


def primary(effects: pd.DataFrame, comparison: str, meaningful: dict[int, float] | None = None) -> pd.DataFrame:
    """The one comparison named before the run, at each budget (rows of `effects` whose effect is `comparison`),
    Holm-adjusted over the budgets; `underpowered` where tied and its detectable difference exceeds that
    budget's meaningful effect."""
    rows = effects[effects["effect"] == comparison].sort_values("budget")
    p_holm = inference.holm(rows["p"].to_numpy())
    out = []
    for row, adjusted in zip(rows.itertuples(), p_holm):
        verdict = inference.verdict(row.ci_low, row.ci_high, adjusted, lower_is_better=True,
                                    detectable=row.detectable, meaningful=(meaningful or {}).get(int(row.budget)))
        out.append({"id": f"P-{int(row.budget)}", "budget": int(row.budget), "comparison": comparison,
                    "samples": int(row.samples), "delta": row.delta, "ci_low": row.ci_low, "ci_high": row.ci_high,
                    "detectable": row.detectable, "p": row.p, "p_holm": adjusted, "verdict": verdict})
    return pd.DataFrame(out, columns=PRIMARY_COLUMNS)


def _difference(row) -> str:
    return f"{row.delta:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]"


def _reading(verdict: str, second: str, first: str) -> str:
    """What a verdict on `second - first` (lower KL is closer to the full cache) says in words."""
    return {"closer": f"{second} is closer to the full cache than {first}",
            "further": f"{second} is further from the full cache than {first}",
            "tied": f"{second} and {first} are tied",
            "underpowered": f"this n cannot tell {second} from {first} at the stated meaningful size"}.get(verdict, verdict)


def _size(row, meaningful: float | None) -> str:
    """A called difference smaller than the meaningful effect, said so (significant is not the same as large)."""
    if meaningful is None or row.verdict not in ("closer", "further") or abs(row.delta) >= meaningful:
        return ""
    return f", smaller than the meaningful {meaningful:g}"


def second_model_sentences(board: pd.DataFrame, model: str, allocation: str, meaningful: float | None = None) -> list[str]:
    """One sentence per budget on the second model: its `allocation` row against its run's baseline, as its
    leaderboard (`board`, leaderboard.csv) tests it, Holm over that table."""
    rows = board[board["method"].astype(str).str.split(":").str[0].eq(allocation) & board["versus"].notna()]
    sentences = []
    for row in rows.sort_values("budget").itertuples():
        said = pd.Series({"verdict": row.kl_verdict, "delta": row.kl_delta_vs_uniform})
        sentences.append(f"On the second model (`{model}`) at B={int(row.budget)}, "
                         f"{_reading(row.kl_verdict, allocation, row.versus)}: KL difference "
                         f"{row.kl_delta_vs_uniform:+.3f} [{row.kl_delta_ci_low:+.3f}, {row.kl_delta_ci_high:+.3f}]"
                         f"{_size(said, meaningful)}, Holm p {row.p_kl_vs_uniform_holm:.2g}, n = {int(row.n)} "
                         "(its leaderboard).")
    return sentences


def verdict_paragraph(primary_rows: pd.DataFrame, effects: pd.DataFrame, meaningful: float | None = None,
                      focus: str | None = None, more: list[str] = ()) -> str:
    """One sentence per budget for the primary comparison, one per budget for the `focus` effect (the question's
    own: the pair's second allocation against the reference, averaged over scorers and splits), and one per budget
    for the largest main effect called, then `more` (the second model's); each names the row it rests on, and a
    called difference under `meaningful` says so."""
    sentences = []
    for row in primary_rows.itertuples():
        second, first = (part.strip() for part in row.comparison.split(" - ", 1))
        sentences.append(f"At B={row.budget}, {_reading(row.verdict, second, first)}: KL difference "
                         f"{_difference(row)}{_size(row, meaningful)}, Holm p {row.p_holm:.2g} over the budgets, "
                         f"n = {row.samples} ({row.id}).")
    for row in effects[effects["effect"] == focus].sort_values("budget").itertuples() if focus else ():
        levels = row.effect.split(": ", 1)[-1]
        second, first = (part.strip() for part in levels.split(" - ", 1))
        sentences.append(f"Averaged over scorers and head splits at B={row.budget}, "
                         f"{_reading(row.verdict, second, first)}: {_difference(row)}{_size(row, meaningful)}, "
                         f"Holm p {row.p_holm:.2g} ({row.id}).")
    mains = effects[(effects["kind"] == "main") & effects["verdict"].isin(["closer", "further"])]
    for budget, rows in mains.groupby("budget", sort=True):
        row = rows.loc[rows["delta"].abs().idxmax()]
        factor, levels = row["effect"].split(": ", 1)
        second, first = (part.strip() for part in levels.split(" - ", 1))
        sentences.append(f"At B={budget} the largest {factor} effect called is {second} against {first}: "
                         f"{row['delta']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}], Holm p "
                         f"{row['p_holm']:.2g} ({row['id']}).")
    sentences += more
    if not sentences:
        return "No comparison has results yet.\n"
    return " ".join(sentences) + "\n"


def primary_markdown(rows: pd.DataFrame) -> str:
    head = ("| id | budget | comparison | n | KL difference [95% CI] | detectable | p | Holm p (budgets) | verdict |\n"
            "|---|---:|---|---:|---|---:|---:|---:|---|")
    lines = [f"| {r.id} | {r.budget} | {r.comparison} | {r.samples} | {_difference(r)} | {r.detectable:.3f} | "
             f"{r.p:.2g} | {r.p_holm:.2g} | {r.verdict} |" for r in rows.itertuples()]
    return "\n".join([head, *lines]) + "\n"


def factorial_markdown(effects: pd.DataFrame) -> str:
    """The factorial table with its ids, one section per budget."""
    parts = []
    for budget, rows in effects.groupby("budget", sort=True):
        parts.append(f"B={budget}:\n\n| id | effect | kind | n | KL difference [95% CI] | detectable | p | Holm p | "
                     "verdict |\n|---|---|---|---:|---|---:|---:|---:|---|")
        parts += [f"| {r.id} | {r.effect} | {r.kind} | {r.samples} | {_difference(r)} | {r.detectable:.3f} | "
                  f"{r.p:.2g} | {r.p_holm:.2g} | {r.verdict} |" for r in rows.itertuples()]
        parts.append("")
    return "\n".join(parts) + "\n"


def calibration_markdown(table: pd.DataFrame) -> str:
    """method, draw, prompt-id hash, prompts, tokens, seconds: one hash per draw for every calibrated method."""
    head = "| method | draw | prompt ids (hash) | prompts | tokens | seconds |\n|---|---:|---|---:|---:|---:|"
    lines = [f"| {r.method} | {r.draw} | `{r.ids_hash}` | {r.prompts} | {r.tokens} | {r.seconds:.0f} |"
             for r in table.itertuples()]
    return "\n".join([head, *lines]) + "\n"
