"""Scaling lines: held-out τ against training tokens, one least-squares line of τ on
log10(tokens) per method, task and training run (`make scaling-runs`: tags scale-<tokens>-<run>).
An extrapolation of a log-linear trend says how fast τ rises with data, not a promise."""

from __future__ import annotations

import math

import pandas as pd

from bench.records import BASELINE


def training_runs(rows: pd.DataFrame) -> pd.Series:
    """Each row's training run (`drafter_run`; "" where it has none): the key of a scaling line."""
    return rows["drafter_run"].fillna("") if "drafter_run" in rows else pd.Series("", index=rows.index)


def scaling_fit(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (method, task, training run) with two or more training sizes: the least-squares
    line of τ on log10(tokens) and its rise per tenfold data. Runs of other settings are
    fitted apart (rows without `drafter_run` form one run)."""
    fits = []
    for (method, task, run), group in rows.groupby(["method", "task", training_runs(rows)]):
        group = group.dropna(subset=["trained_tokens", "tau"])
        if group["trained_tokens"].nunique() < 2:
            continue
        x = group["trained_tokens"].map(math.log10)
        slope = float(((x - x.mean()) * (group["tau"] - group["tau"].mean())).sum() / ((x - x.mean()) ** 2).sum())
        largest = group.loc[group["trained_tokens"].idxmax()]
        drafter = largest.get("drafter_id") if "drafter_id" in group else None
        fits.append({"method": method, "task": task, "run": run, "sizes": int(group["trained_tokens"].nunique()),
                     "drafter_id": drafter if isinstance(drafter, str) else None,  # the largest size's
                     "largest_tokens": float(largest["trained_tokens"]), "tau_at_largest": float(largest["tau"]),
                     "tau_per_10x": slope})
    return pd.DataFrame(fits)


def scaling_rows(per_task: pd.DataFrame) -> pd.DataFrame:
    """The rows a scaling fit reads: each training run's drafters at two or more sizes."""
    rows = per_task[per_task["method"].ne(BASELINE)] if "trained_tokens" in per_task else per_task.iloc[0:0]
    rows = rows[rows["trained_tokens"].notna()] if not rows.empty else rows
    if not rows.empty:  # one training run's drafters per line: a run with two or more sizes
        sizes = rows.groupby(["method", training_runs(rows)])["trained_tokens"].transform("nunique")
        rows = rows[sizes >= 2]
    return rows
