"""The papers' regime through our loop: at each τ a paper published, the speedup this decode
loop reaches for the same method on this machine when its drafts are accepted that often.

Oracle acceptance (bench.core.oracle) keeps a method's real draft pass, tree shape and
verification and sets only how much is accepted. `python -m bench.paper_regime` runs every
(method, task) the papers' tables (bench/report/paper_tables.json) give a τ for at the acceptances
ACCEPTS (tags oracle<a>, greedy, resumable). The report reads those runs' (τ, speedup) points
and interpolates the speedup at the published τ, beside the paper's own speedup where it gave
one: what our system costs, apart from what our drafters accept. A published τ past the
method's τ at acceptance 1 is out of reach for its draft shape here, and the table says so.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd

from bench.report.paper_tables import PaperTable, load_paper_tables

ACCEPTS = (0.5, 0.7, 0.85, 0.95, 1.0)
LIMIT, MAX_NEW_TOKENS = 3, 128  # questions per task and tokens per turn of each oracle run
ORACLE_PREFIX = "oracle"


def oracle_tag(accept: float) -> str:
    """oracle0.5, ..., oracle1.0: the tags `make oracle-sweep` writes too."""
    return f"{ORACLE_PREFIX}{accept}"


def published_pairs(tables: list[PaperTable]) -> list[tuple[str, str]]:
    """Every (method, task) some paper's table gives a τ for, in the tables' order."""
    pairs: list[tuple[str, str]] = []
    for table in tables:
        for cell in table.cells:
            if cell["metric"] == "tau" and (cell["method"], cell["task"]) not in pairs:
                pairs.append((cell["method"], cell["task"]))
    return pairs


def speedup_at(points: pd.DataFrame, tau: float) -> tuple[float, str]:
    """The speedup at `tau` read off one method's measured (τ, speedup) points on one task by
    linear interpolation, and how it was read; nan where `tau` lies outside the points."""
    curve = points.dropna(subset=["tau", "speedup"]).groupby("tau")["speedup"].mean()
    if len(curve) < 2:
        return float("nan"), "fewer than two oracle runs"
    if tau > curve.index[-1]:
        return float("nan"), f"out of reach: the sweep's highest τ is {curve.index[-1]:.2f}"
    if tau < curve.index[0]:
        return float("nan"), f"below the sweep's lowest τ ({curve.index[0]:.2f})"
    below, above = curve.index[curve.index <= tau].max(), curve.index[curve.index >= tau].min()
    return float(np.interp(tau, curve.index, curve.values)), f"between τ {below:.2f} and {above:.2f}"


def regime_table(tables: list[PaperTable], per_task: pd.DataFrame | None) -> pd.DataFrame:
    """One row per published τ: the paper's τ and speedup, and our loop's speedup at that τ
    (from the oracle series in `per_task`, the rows with an `oracle_accept`)."""
    oracle = per_task[per_task["oracle_accept"].notna()] if per_task is not None and "oracle_accept" in per_task \
        else pd.DataFrame(columns=["method", "task", "tau", "speedup"])
    rows = []
    for table in tables:
        published = {(c["method"], c["task"], c["metric"]): c["published"] for c in table.cells}
        for (method, task, metric), tau in published.items():
            if metric != "tau":
                continue
            points = oracle[(oracle["method"] == method) & (oracle["task"] == task)]
            ours, how = speedup_at(points, float(tau)) if not points.empty else (float("nan"), "not run")
            theirs = published.get((method, task, "speedup"))
            rows.append({"paper": table.key, "method": method, "task": task, "published τ": f"{tau:g}",
                         "published speedup": "-" if theirs is None else f"{theirs:g}x",
                         "our loop at that τ": "-" if ours != ours else f"{ours:.2f}x", "how": how})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the oracle series for every published (method, task): `bench run` each, resumable."""
    for method, task in published_pairs(load_paper_tables()):
        for accept in ACCEPTS:
            command = [sys.executable, "-m", "bench.cli", "run", "--method", method, "--task", task, "--limit",
                       str(LIMIT), "--max-new-tokens", str(MAX_NEW_TOKENS), "--tag", oracle_tag(accept),
                       "--option", f"oracle_accept={accept}", *(argv or [])]
            print(" ".join(["bench", *command[3:]]), flush=True)
            code = subprocess.call(command)
            if code:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
