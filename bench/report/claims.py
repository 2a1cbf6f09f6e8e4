"""The papers' claims, checked on the records on the claim's own definition.

One row per claim: what the paper (or the survey the project follows) says, where, what the
kept records measure on the same definition, and a verdict: agree, disagree, or not testable
here (with the reason: the series it needs is not kept, or the setting cannot be matched).
Computed from the records each time the report is made, so it changes when the data does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

AGREE, DISAGREE, UNTESTABLE = "agree", "disagree", "not testable here"


@dataclass(frozen=True)
class Evidence:
    """What the claims read: the grid's per-task and pooled tables, the block sweep's per-task
    rows (series b4, b8, b16), the load sweep's (series load<B>), the kept hardware profiles."""

    per_task: pd.DataFrame
    overall: pd.DataFrame
    blocks: pd.DataFrame | None = None
    load: pd.DataFrame | None = None
    profiles: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Claim:
    claim: str
    source: str
    check: Callable[[Evidence], tuple[str, str, str]]  # -> (measured, verdict, why)


def _value(frame: pd.DataFrame | None, method: str, column: str, **where) -> float:
    if frame is None or frame.empty or column not in frame:
        return math.nan
    rows = frame[frame["method"] == method]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    return float(rows[column].iloc[0]) if len(rows) else math.nan


def _known(*values: float) -> bool:
    return all(v == v for v in values)


def _tasks(evidence: Evidence) -> list[str]:
    return sorted(set(evidence.per_task["task"])) if not evidence.per_task.empty else []


def _block_growth(evidence: Evidence) -> tuple[str, str, str]:
    frame = evidence.blocks
    if frame is None or frame.empty:
        return "-", UNTESTABLE, "no block sweep kept (make block-sweep: series b4, b8, b16)"
    taus = {m: [_value(frame, m, "tau", series=f"b{k}") for k in (4, 8, 16)] for m in ("dflash", "mtp")}
    if not all(_known(*v) for v in taus.values()):
        return "-", UNTESTABLE, "the block sweep lacks dflash or mtp at block 4, 8 or 16"
    dflash, mtp = taus["dflash"], taus["mtp"]
    measured = (f"DFlash τ {dflash[0]:.2f} / {dflash[1]:.2f} / {dflash[2]:.2f}, MTP {mtp[0]:.2f} / {mtp[1]:.2f} / "
                f"{mtp[2]:.2f} at 4 / 8 / 16 (HumanEval)")
    grows = dflash[2] > dflash[1] > dflash[0]
    saturates = mtp[2] - mtp[1] <= 0.5 * max(1e-9, mtp[1] - mtp[0])
    if grows and saturates:
        return measured, AGREE, ""
    why = "DFlash's τ does not rise with every doubling of the block" if not grows else \
        "MTP's τ still rises past 8 as much as before it"
    return measured, DISAGREE, why


def _conditional_tail(evidence: Evidence, method: str) -> float:
    rows = evidence.overall[evidence.overall["method"] == method] if not evidence.overall.empty else pd.DataFrame()
    if rows.empty or "accept_cond" not in rows:
        return math.nan
    values = [a for a in list(rows["accept_cond"].iloc[0])[3:8] if a == a]
    return sum(values) / len(values) if values else math.nan


def _dspark_decays_less(evidence: Evidence) -> tuple[str, str, str]:
    dspark, dflash = _conditional_tail(evidence, "dspark"), _conditional_tail(evidence, "dflash")
    if not _known(dspark, dflash):
        return "-", UNTESTABLE, "no grid rows for dspark and dflash with per-position acceptance"
    measured = f"conditional acceptance at draft positions 4-8: DSpark {dspark:.2f}, DFlash {dflash:.2f} (pooled)"
    return measured, AGREE if dspark > dflash else DISAGREE, ""


def _eagle_order(evidence: Evidence) -> tuple[str, str, str]:
    tasks = _tasks(evidence)
    rows = {t: [_value(evidence.per_task, m, "tau", task=t) for m in ("eagle3", "eagle2", "eagle")] for t in tasks}
    rows = {t: v for t, v in rows.items() if _known(*v)}
    if not rows:
        return "-", UNTESTABLE, "no task with all three EAGLE generations in the grid"
    measured = "; ".join(f"{t}: {a:.2f} > {b:.2f} > {c:.2f}" for t, (a, b, c) in rows.items())
    held = [t for t, (a, b, c) in rows.items() if a > b > c]
    return measured, AGREE if len(held) == len(rows) else DISAGREE, \
        "" if len(held) == len(rows) else f"ordered on {len(held)} of {len(rows)} tasks"


def _eagle3_speedup(evidence: Evidence) -> tuple[str, str, str]:
    three, two = _value(evidence.overall, "eagle3", "speedup"), _value(evidence.overall, "eagle2", "speedup")
    if not _known(three, two) or two <= 0:
        return "-", UNTESTABLE, "no pooled speedups for eagle3 and eagle2"
    ratio = three / two
    measured = f"EAGLE-3 {three:.2f}x, EAGLE-2 {two:.2f}x AR: ratio {ratio:.2f}"
    return measured, AGREE if 1.2 <= ratio else DISAGREE, \
        "" if ratio >= 1.2 else "the ratio is under 1.2 (the paper's ~1.4 within its spread)"


def _ddtree_beyond(evidence: Evidence) -> tuple[str, str, str]:
    values = [_value(evidence.overall, m, c) for m in ("ddtree", "dflash") for c in ("tau", "speedup")]
    if not _known(*values):
        return "-", UNTESTABLE, "no pooled rows for ddtree and dflash"
    tree_tau, tree_speed, tau, speed = values
    measured = f"τ {tree_tau:.2f} vs {tau:.2f}; speedup {tree_speed:.2f}x vs {speed:.2f}x"
    both = tree_tau > tau and tree_speed > speed
    return measured, AGREE if both else DISAGREE, "" if both else \
        ("higher τ, lower speedup: the tree's verification costs more here" if tree_tau > tau else "")


def _medusa_decay(evidence: Evidence) -> tuple[str, str, str]:
    rows = evidence.overall[evidence.overall["method"] == "medusa"] if not evidence.overall.empty else pd.DataFrame()
    if rows.empty or "accept_uncond" not in rows:
        return "-", UNTESTABLE, "no grid row for medusa"
    acceptance = [a for a in list(rows["accept_uncond"].iloc[0]) if a == a]
    if len(acceptance) < 3:
        return "-", UNTESTABLE, "medusa's rounds drafted fewer than 3 positions (its default tree here)"
    measured = "marginal acceptance by position " + " / ".join(f"{a:.2f}" for a in acceptance[:4])
    fast = acceptance[2] <= 0.5 * acceptance[0]
    return measured, AGREE if fast else DISAGREE, "" if fast else "position 3 keeps more than half of position 1"


def _batch_erodes(evidence: Evidence) -> tuple[str, str, str]:
    frame = evidence.load
    if frame is None or frame.empty or "batch_size" not in frame:
        return "-", UNTESTABLE, "no load sweep kept (make load-sweep: series load<B>)"
    speedups = frame[frame["method"] != "ar"].groupby("batch_size")["speedup"].median().sort_index()
    speedups = speedups.dropna()
    if len(speedups) < 2:
        return "-", UNTESTABLE, "the load sweep has fewer than two batch sizes"
    measured = "median speedup over methods by batch size: " + ", ".join(
        f"B={int(b)} {s:.2f}x" for b, s in speedups.items())
    falls = speedups.iloc[-1] < speedups.iloc[0]
    return measured, AGREE if falls else DISAGREE, ""


def _verify_cost(evidence: Evidence) -> tuple[str, str, str]:
    found = []
    for profile in evidence.profiles:
        chain = {row["k"]: row["ratio_to_k1"] for row in profile.get("rows", []) if row.get("kind") == "chain"}
        if 8 in chain:
            name = (profile.get("provenance") or {}).get("device_name", "?")
            found.append((name, profile.get("dtype", "?"), chain[8], chain.get(16, math.nan)))
    if not found:
        return "-", UNTESTABLE, "no hardware profile kept (bench profile)"
    measured = "; ".join(f"{n} {d}: t_v(8)/t_v(1) {r8:.2f}, t_v(16)/t_v(1) {r16:.2f}" for n, d, r8, r16 in found)
    near = all(r8 <= 1.3 for _, _, r8, _ in found)
    return measured, AGREE if near else DISAGREE, "" if near else "verifying 8 tokens costs over 1.3 steps here"


def _lossless(evidence: Evidence) -> tuple[str, str, str]:
    frame = evidence.per_task
    if frame.empty or "match_rate" not in frame:
        return "-", UNTESTABLE, "no grid rows"
    rows = frame[(frame["method"] != "ar") & frame["match_rate"].notna()]
    if rows.empty:
        return "-", UNTESTABLE, "no greedy rows"
    worst = rows["match_rate"].min()
    mismatches = int(rows["mismatches"].sum()) if "mismatches" in rows else 0
    measured = (f"greedy: {len(rows)} method-task cells, lowest exact match {100 * worst:.1f}%, {mismatches} real "
                "mismatches (sampling: tests/test_lossless_stats.py checks the distribution)")
    return measured, AGREE if worst == 1.0 else DISAGREE, "" if worst == 1.0 else "a greedy turn differs from AR"


CLAIMS = [
    Claim("DFlash's acceptance keeps growing with the block size, while MTP-style drafts saturate past 8",
          "survey (shared/seeds), DFlash arXiv 2602.06036 §4", _block_growth),
    Claim("DSpark's acceptance decays less along the block than DFlash's", "DSpark arXiv 2607.05147 §5",
          _dspark_decays_less),
    Claim("EAGLE-3 > EAGLE-2 > EAGLE in acceptance length on every benchmark", "EAGLE-3 arXiv 2503.01840 Table 1",
          _eagle_order),
    Claim("EAGLE-3's speedup is about 1.4x EAGLE-2's", "EAGLE-3 arXiv 2503.01840 abstract", _eagle3_speedup),
    Claim("DDTree goes beyond DFlash: longer acceptance and higher speedup", "DDTree repository results table",
          _ddtree_beyond),
    Claim("Medusa's acceptance decays fast with the head's position", "Medusa arXiv 2401.10774 §3", _medusa_decay),
    Claim("Speculation loses ground as the batch grows", "survey (shared/seeds); DSpark §6 (serving)",
          _batch_erodes),
    Claim("Verifying k draft tokens costs about one target step", "survey (shared/seeds); Leviathan et al. §3",
          _verify_cost),
    Claim("The output distribution is the target's (lossless)", "Leviathan et al. 2211.17192; Chen et al. "
          "2302.01318", _lossless),
]


def claims_table(evidence: Evidence) -> pd.DataFrame:
    rows = []
    for claim in CLAIMS:
        measured, verdict, why = claim.check(evidence)
        rows.append({"claim": claim.claim, "source": claim.source, "measured here": measured, "verdict": verdict,
                     "why": why or "-"})
    return pd.DataFrame(rows)
