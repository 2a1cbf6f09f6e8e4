"""The drafters' goals (greedy, the grid's suites and settings) against what the records measured.

Each goal is checked per task on the report's per-task table; a missed τ goal says by how
much, and, where the scaling runs (`make scaling-runs`) fitted a line of τ on log10(training
tokens) for that method and task, about how many training tokens the line reaches it at.
Goals follow the literature's orderings at the papers' training scales (methods/README.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from bench.records import BASELINE

# τ at least this much, per method and task ("*": every task the method ran on).
TAU_GOALS: dict[str, dict[str, float]] = {"eagle3": {"mtbench": 3.0}, "dflash": {"humaneval": 3.5, "gsm8k": 3.5},
                                          "medusa": {"*": 2.0}, "mtp": {"*": 2.0}}
TAU_AT_LEAST_OTHER = [("dflash", "eagle3", 1.0, ("humaneval", "gsm8k")),  # DFlash >= EAGLE-3 on code and math
                      ("dspark", "dflash", 1.1, ("*",))]  # DSpark >= 1.1x DFlash at the same block
TAU_ORDER = ("eagle3", "eagle2", "eagle")  # strictly decreasing τ on every task
SPEEDUP_ABOVE_ONE = ("eagle2", "eagle3", "dflash", "ddtree", "dspark")
# The tree methods at their references' default draft sizes (`make paper-draft`), where this CPU's
# defaults are smaller: τ is bounded by the draft's shape, so its goals are checked there too.
PAPER_DRAFT_TAG = "paper-draft"
AT_PAPER_DRAFT = " at the references' draft sizes"
# MTP's parallel variant (Gloeckle's heads) trained at scale and not shipped (`make mtp-parallel`):
# the shipped MTP is the sequential one, so the MTP goal is checked on this series too.
MTP_PARALLEL_TAG = "mtp-parallel"
MTP_PARALLEL = " (parallel variant)"
# The series besides the grid whose τ goals the report checks, each goal's name suffixed so.
NAMED_SERIES = {PAPER_DRAFT_TAG: AT_PAPER_DRAFT, MTP_PARALLEL_TAG: MTP_PARALLEL}
HELDOUT_TOP1 = {"sps": 0.6}  # the drafter's held-out top-1 agreement at draft position 0 (its manifest)
# The decode path's goals on a native-bf16 CPU with 2 threads, read from `bench profile` records.
CPU_STEP_OVER_MEMORY_LIMIT = 1.6  # the one-token step at most this multiple of weight bytes / read bandwidth
CPU_OVER_HF_GENERATE = 1.8  # the one-token step at least this much faster than transformers.generate
CPU_VERIFY_16 = 1.3  # t_v(16) / t_v(1) at most this


def tau_goal(method: str, task: str) -> float | None:
    goals = TAU_GOALS.get(method, {})
    return goals.get(task, goals.get("*"))


def training_runs(rows: pd.DataFrame) -> pd.Series:
    """Each row's training run (`drafter_run`; "" where it has none): the key of a scaling line."""
    return rows["drafter_run"].fillna("") if "drafter_run" in rows else pd.Series("", index=rows.index)


def scaling_fit(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (method, task, training run) with two or more training sizes: the least-squares
    line of τ on log10(tokens), its rise per tenfold data, and, where the method has a goal
    for the task and the line rises, the tokens at which it would reach the goal. An
    extrapolation of a log-linear trend, so an estimate of the data needed, not a promise.
    Runs of other settings are fitted apart (rows without `drafter_run` form one run)."""
    fits = []
    for (method, task, run), group in rows.groupby(["method", "task", training_runs(rows)]):
        group = group.dropna(subset=["trained_tokens", "tau"])
        if group["trained_tokens"].nunique() < 2:
            continue
        x = group["trained_tokens"].map(math.log10)
        slope = float(((x - x.mean()) * (group["tau"] - group["tau"].mean())).sum() / ((x - x.mean()) ** 2).sum())
        intercept = float(group["tau"].mean() - slope * x.mean())
        goal = tau_goal(method, task)
        largest = group.loc[group["trained_tokens"].idxmax()]
        needed = float("nan")
        if goal is not None and float(largest["tau"]) >= goal:
            needed = float(largest["trained_tokens"])
        elif goal is not None and slope > 0:
            needed = 10 ** ((goal - intercept) / slope)
        drafter = largest.get("drafter_id") if "drafter_id" in group else None
        fits.append({"method": method, "task": task, "run": run, "sizes": int(group["trained_tokens"].nunique()),
                     "drafter_id": drafter if isinstance(drafter, str) else None,  # the largest size's
                     "largest_tokens": float(largest["trained_tokens"]), "tau_at_largest": float(largest["tau"]),
                     "tau_per_10x": slope, "goal": float("nan") if goal is None else goal,
                     "tokens_to_goal": needed})
    return pd.DataFrame(fits)


def scaling_rows(per_task: pd.DataFrame) -> pd.DataFrame:
    """The rows a scaling fit reads: each training run's drafters at two or more sizes."""
    rows = per_task[per_task["method"].ne(BASELINE)] if "trained_tokens" in per_task else per_task.iloc[0:0]
    rows = rows[rows["trained_tokens"].notna()] if not rows.empty else rows
    if not rows.empty:  # one training run's drafters per line: a run with two or more sizes
        sizes = rows.groupby(["method", training_runs(rows)])["trained_tokens"].transform("nunique")
        rows = rows[sizes >= 2]
    return rows


def _cell(per_task: pd.DataFrame, method: str, task: str) -> pd.Series | None:
    rows = per_task[(per_task["method"] == method) & (per_task["task"] == task)]
    return None if rows.empty else rows.iloc[0]


def _tokens(n: float) -> str:
    if n >= 1e12:
        return f"{n:.1e}"
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _to_goal(fit: pd.DataFrame | None, method: str, task: str, cell: pd.Series | None = None) -> str:
    """The fitted line's training tokens at the goal, from the scaling runs, where there is one.
    Where the cell's drafter is not the line's (another run's weights), the line's slope from the
    cell's own τ and training tokens, said so (drafters told apart by `drafter_id`)."""
    if fit is None or fit.empty:
        return "no scaling runs for it"
    rows = fit[(fit["method"] == method) & (fit["task"] == task)]
    if rows.empty:
        return "no scaling runs for it"
    mine = cell.get("drafter_id") if cell is not None else None
    own = rows[rows["drafter_id"] == mine] if isinstance(mine, str) and "drafter_id" in rows else rows.iloc[0:0]
    rows = own if not own.empty else rows  # the cell's own drafter's line, else the run trained furthest
    row = rows.loc[rows["largest_tokens"].idxmax()]
    if isinstance(mine, str) and isinstance(row.get("drafter_id"), str) and mine != row["drafter_id"]:
        slope, tokens, goal = row["tau_per_10x"], cell.get("trained_tokens"), tau_goal(method, task)
        if slope <= 0 or goal is None or not isinstance(tokens, float | int) or math.isnan(tokens):
            return "no scaling runs of this drafter (an earlier drafter's line does not tell)"
        needed = tokens * 10 ** ((goal - cell["tau"]) / slope)
        return (f"~{_tokens(needed)} training tokens at the slope of an earlier drafter's scaling line "
                f"({slope:+.2f} τ per tenfold data; no scaling runs of this drafter)")
    if math.isnan(row["tokens_to_goal"]):
        return f"the scaling line does not rise ({row['tau_per_10x']:+.2f} τ per tenfold data)"
    return (f"~{_tokens(row['tokens_to_goal'])} training tokens by the scaling line "
            f"({row['tau_per_10x']:+.2f} τ per tenfold data, fitted up to {_tokens(row['largest_tokens'])})")


OUT_OF_REACH = "out of reach at these settings"


def _ceiling(cell: pd.Series, goal: float) -> str:
    """Where the default settings' drafts were too shallow for the goal even if all were accepted."""
    ceiling = cell.get("tau_ceiling", math.nan)
    if pd.isna(ceiling) or ceiling >= goal:
        return ""
    return (f"; {OUT_OF_REACH}: its drafts were {ceiling - 1:.2f} deep on average, so τ ≤ "
            f"{ceiling:.2f} with every draft accepted, whatever the drafter")


def _heldout_top1(row: pd.Series) -> tuple[float, str] | None:
    """Draft position 0's held-out top-1 agreement, as the training of the drafter a run ran
    recorded it, and the folder it was read from. Where the run recorded its weights' digest,
    the folder must still hold those weights: the folder it ran from (a training folder can be
    gone with its machine, or hold a later drafter), else the shipped drafter if it is the same."""
    from pathlib import Path

    from bench.core.drafters import heldout_of, read_manifest, shipped_dirs, weights_sha1
    from bench.core.errors import BenchError

    weights = row.get("drafter_weights")
    weights = weights if isinstance(weights, str) else None
    shipped = shipped_dirs(str(row.get("target")), str(row["method"])) if weights else []
    for folder in [Path(str(row["drafter_run"])), *shipped]:
        if weights and weights_sha1(folder) != weights:
            continue
        try:
            agreement = heldout_of(read_manifest(folder)).get("top1_by_position") or []
        except BenchError:  # the drafter folder gone or unreadable since the run: not measured
            continue
        if agreement:
            where = "the shipped drafter" if any(folder.resolve() == d.resolve() for d in shipped) else str(folder)
            return float(agreement[0]), where
    return None


def profile_goals(profiles: list[dict]) -> list[dict]:
    """The CPU decode path's goals, one row per goal and kept bf16 two-thread CPU profile (its
    file name in the task column): the step against the memory-bound limit and against
    transformers.generate, and t_v(16)/t_v(1) beside the least the measured matmul rate allows."""
    rows = []
    for profile in profiles:
        prov = profile.get("provenance") or {}
        chain = {r["k"]: r["median_s"] for r in profile.get("rows", []) if r.get("kind") == "chain"}
        if profile.get("dtype") != "bfloat16" or prov.get("torch_threads") != 2 or 1 not in chain \
                or "cuda" in str(prov.get("device_name", "")).lower():
            continue
        where = Path(profile["path"]).stem
        over = (profile.get("memory_bound") or {}).get("step_over_limit")
        if over is not None:
            rows.append(_row(f"CPU one-token step ≤ {CPU_STEP_OVER_MEMORY_LIMIT:g}x the memory-bound limit", where,
                             f"{over:.2f}x", over <= CPU_STEP_OVER_MEMORY_LIMIT, over_what=MACHINES))
        hf = (profile.get("hf_generate") or {}).get("step_s")
        if hf:
            faster = hf / chain[1]
            rows.append(_row(f"CPU one-token step ≥ {CPU_OVER_HF_GENERATE:g}x faster than transformers.generate",
                             where, f"{faster:.2f}x", faster >= CPU_OVER_HF_GENERATE, over_what=MACHINES))
        if 16 in chain:
            ratio, least = chain[16] / chain[1], (profile.get("compute_bound") or {}).get("least_ratio_to_k1")
            note = "" if least is None else (f"the measured matmul rate allows no less than {least:.2f} here"
                                             + (": out of reach on this CPU" if least > CPU_VERIFY_16 else ""))
            rows.append(_row(f"CPU t_v(16)/t_v(1) ≤ {CPU_VERIFY_16:g}", where, f"{ratio:.2f}",
                             ratio <= CPU_VERIFY_16, note, over_what=MACHINES))
    return rows


MACHINES = "machines"  # a goal checked per kept hardware profile, not per task


def _row(goal: str, task: str, measured: str, met: bool | None, note: str = "", over_what: str = "tasks") -> dict:
    status = ("not run" if measured == "-" else "not measured") if met is None else ("met" if met else "missed")
    return {"goal": goal, "task": task, "measured": measured, "status": status, "note": note, "over": over_what}


def tau_rows(per_task: pd.DataFrame, fit: pd.DataFrame | None = None, where: str = "") -> list[dict]:
    """The τ goals (at least a value, at least another method's, the EAGLE order) on one series;
    `where` names a series other than the grid's defaults in each goal's name."""
    rows = []
    tasks = sorted(per_task["task"].unique())
    ran = set(per_task["method"])

    def add(goal: str, task: str, measured: str, met: bool | None, note: str = "") -> None:
        rows.append(_row(goal + where, task, measured, met, note))

    for method, goals in TAU_GOALS.items():
        for task in tasks if "*" in goals else [t for t in goals if t in tasks]:
            goal, cell = tau_goal(method, task), _cell(per_task, method, task)
            if cell is None:
                if not where:  # a named series checks only what it ran
                    add(f"{method} τ ≥ {goal:g}", task, "-", None)
                continue
            met = cell["tau"] >= goal
            fitted = "" if where else f"; {_to_goal(fit, method, task, cell)}"  # the scaling lines ran at the defaults
            short = f"short by {goal - cell['tau']:.2f}{fitted}{_ceiling(cell, goal)}"
            add(f"{method} τ ≥ {goal:g}", task, f"τ {cell['tau']:.2f}", met, "" if met else short)
    for method, other, ratio, goal_tasks in TAU_AT_LEAST_OTHER:
        for task in tasks if "*" in goal_tasks else [t for t in goal_tasks if t in tasks]:
            mine, theirs = _cell(per_task, method, task), _cell(per_task, other, task)
            name = f"{method} τ ≥ {'' if ratio == 1 else f'{ratio:g} × '}{other} τ"
            if mine is None or theirs is None:
                if not where:
                    add(name, task, "-", None)
                continue
            share = mine["tau"] / theirs["tau"]
            add(name, task, f"{mine['tau']:.2f} vs {theirs['tau']:.2f} ({share:.2f}x)", share >= ratio)
    if set(TAU_ORDER) <= ran:
        for task in tasks:
            cells = [_cell(per_task, m, task) for m in TAU_ORDER]
            if any(c is None for c in cells):
                continue
            taus = [c["tau"] for c in cells]
            add(" > ".join(f"{m} τ" for m in TAU_ORDER), task, " / ".join(f"{t:.2f}" for t in taus),
                all(a > b for a, b in zip(taus, taus[1:])))
    return rows


def goals_table(per_task: pd.DataFrame, fit: pd.DataFrame | None = None,
                tuned: pd.DataFrame | None = None, profiles: list[dict] | None = None,
                named: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """One row per goal and task: the measured value, met or missed (by how much), and for a
    missed τ goal what the scaling fit says more data would do. One series per table: the
    caller selects it (the newest revision of the grid). `tuned`: the per-task table of the
    grid run at each method's tuned budget (`--budget auto`), whose speedups are checked too.
    `profiles`: the kept `bench profile` records, for the CPU decode path's goals. `named`: the
    per-task tables of NAMED_SERIES by tag (the tree methods at their references' draft sizes,
    MTP's parallel variant), whose τ goals are checked too, each named so."""
    if per_task.empty:
        return pd.DataFrame()
    rows = []
    tasks = sorted(per_task["task"].unique())

    def add(goal: str, task: str, measured: str, met: bool | None, note: str = "") -> None:
        rows.append(_row(goal, task, measured, met, note))

    for method, goal in HELDOUT_TOP1.items():
        runs = per_task.loc[per_task["method"] == method].dropna(subset=["drafter_run"]) \
            if "drafter_run" in per_task else pd.DataFrame()
        if runs.empty:
            add(f"{method} draft top-1 agreement ≥ {goal:g}", "held out", "-", None)
            continue
        found = _heldout_top1(runs.iloc[0])
        if found is None:
            add(f"{method} draft top-1 agreement ≥ {goal:g}", "held out", "not in its manifest", None,
                "its drafter was trained before held-out agreement was recorded, or is gone")
            continue
        top1, folder = found
        add(f"{method} draft top-1 agreement ≥ {goal:g}", "held out", f"{top1:.2f}", top1 >= goal,
            (f"short by {goal - top1:.2f}; " if top1 < goal else "") + f"as recorded by {folder}")

    rows += tau_rows(per_task, fit)
    for tag, table in (named or {}).items():
        if table is not None and not table.empty:
            rows += tau_rows(table, where=NAMED_SERIES[tag])
    for method in SPEEDUP_ABOVE_ONE:
        for series, where, label in ((per_task, "", ""), (tuned, " at its tuned budget", "budget ")):
            if series is None or series.empty:
                continue
            for task in tasks:
                cell = _cell(series, method, task)
                if cell is None or pd.isna(cell.get("speedup")):
                    add(f"{method} speedup > 1{where}", task, "-", None)
                    continue
                budget = f" ({label}{int(cell['budget'])})" if label and not pd.isna(cell.get("budget")) else ""
                add(f"{method} speedup > 1{where}", task, f"{cell['speedup']:.2f}x{budget}", cell["speedup"] > 1.0,
                    "" if cell["speedup"] > 1.0 else f"{1 / cell['speedup']:.2f}x slower than AR")
    methods = per_task[per_task["method"].ne(BASELINE) & per_task["match_rate"].notna()]
    for task, group in methods.groupby("task"):  # a divergence at a near tie of the parting tokens is told apart
        inexact, ties = group[group["mismatches"] > 0], group[group["near_ties"] > 0]
        add("every method 100% exact against AR", task, f"{len(group) - len(inexact)} of {len(group)} methods",
            inexact.empty, "; ".join([f"{r.method}: {r.mismatches} mismatched turns" for r in inexact.itertuples()]
                                     + [f"{r.method}: {r.near_ties} near ties" for r in ties.itertuples()]))
    rows += profile_goals(profiles or [])
    return pd.DataFrame(rows)


GOAL_SERIES = ("grid", "full")  # the goals are stated for the grid's suites and settings


def goals_summary(frame: pd.DataFrame) -> str:
    """One Markdown line per goal: on how many tasks it is met, and the misses' measurements."""
    lines = []
    for goal, group in frame.groupby("goal", sort=False):
        met, missed = group[group["status"] == "met"], group[group["status"] == "missed"]
        unmeasured = group[group["status"].isin(["not run", "not measured"])]
        text = f"- {goal}: met on {len(met)} of {len(group)} {group['over'].iloc[0] if 'over' in group else 'tasks'}"
        if not missed.empty:
            text += "; missed on " + ", ".join(f"{r.task} ({r.measured})" for r in missed.itertuples())
        shallow = missed[missed["note"].str.contains(OUT_OF_REACH, regex=False)] if "note" in missed else missed[:0]
        if not shallow.empty:
            text += f"; {OUT_OF_REACH} (drafts too shallow for it even if all were accepted) on {len(shallow)}"
        if not unmeasured.empty:
            text += "; not measured on " + ", ".join(unmeasured["task"])
        lines.append(text)
    return "\n".join(lines)
