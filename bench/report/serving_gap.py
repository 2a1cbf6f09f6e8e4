"""Training against serving: the τ a drafter's held-out numbers predict beside the τ measured.

A trained drafter's manifest predicts τ from held-out replies (decode rounds replayed on
their first 128 tokens: what the grid decodes); its run records carry that prediction
(bench.core.drafters.drafter_info). A measured τ more than GAP below or above it is
flagged with its likely cause: the users of SpecForge and speculators report this failure
most (high training accuracy, low serving acceptance).
"""

from __future__ import annotations

import pandas as pd

from bench import metrics

GAP = 0.10


def likely_cause(method: str, predicted: float, measured: float, greedy: bool, budget: object) -> str:
    if not greedy:
        return "sampled decoding (the prediction is greedy)"
    if measured < predicted:
        return ("the evaluation prompts differ from the training replies (task shift), or the decode loop drafts "
                "a shorter or narrower draft than the replay" + (f" (budget {budget})" if budget else ""))
    return "a tree or wider draft than the replay's single chain accepts more"


def gap_table(runs: list) -> pd.DataFrame:
    """One row per (method, task, series) whose records name a drafter's prediction."""
    rows = []
    for run in runs:
        drafter = run.settings.get("drafter") or {}
        predicted = (drafter.get("heldout") or {}) if isinstance(drafter, dict) else {}
        value = predicted.get("rounds_tau_first_128") or predicted.get("rounds_tau") or predicted.get("predicted_tau")
        if not value or not run.pooled:
            continue
        measured = metrics.tau(run.pooled)
        if measured != measured:
            continue
        greedy = float((run.settings.get("sampling") or {}).get("temperature", 0.0)) == 0.0
        gap = measured / value - 1
        rows.append({"method": run.method, "task": run.task, "series": run.series, "turns": len(run.pooled),
                     "predicted τ (held-out, first 128)": round(value, 2), "measured τ": round(measured, 2),
                     "gap": f"{gap:+.0%}",
                     "flag": likely_cause(run.method, value, measured, greedy,
                                          (run.settings.get("method_options") or {}).get("budget"))
                     if abs(gap) > GAP else ""})
    return pd.DataFrame(rows)
