"""Earlier revisions beside the newest: what a retrained drafter or new defaults changed.

bench.grid never overwrites finished records: a cell whose settings changed (a retrained
drafter, another dtype) runs into the next revision of its tag (`grid.r2`, ...), and the
tables show the newest. This module puts the older revisions back beside it, each summarized
as the tables summarize the newest (τ, speedup against the baseline of its own revision),
with the settings that changed, so a report shows the old and the new numbers side by side.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from bench.records import BASELINE, RunFile, parse_tag, pool_repeats
from bench.report.tables import Records, summarize

NEWEST = "(newest)"


def _key(run: RunFile) -> tuple[str, str, str, str]:
    return run.target, run.series, run.task, run.method


def _generation(run: RunFile) -> str:
    """What a run was recorded with, less its task: the cells of one set of settings (one
    drafter, sized alike) across tasks, whose revision numbers differ where a task was rerun
    more often. A task has one revision per set of settings (bench.grid), so none is pooled twice."""
    return json.dumps({k: v for k, v in run.settings.items() if k not in ("task", "tag")}, sort_keys=True, default=str)


def _age(runs: list[RunFile]) -> tuple[int, int]:
    """Oldest generation first: by the revisions its runs were recorded under."""
    return min(r.revision for r in runs), max(r.revision for r in runs)


def _changed(old: dict, new: dict) -> str:
    """The top-level settings that differ (a retrained drafter shows as `drafter`)."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in ("tag", "git_sha"))
    return ", ".join(keys) or "nothing recorded"


def _summary(runs: list[RunFile], keys: set, by: str, baselines: list[RunFile]) -> pd.DataFrame:
    """summarize() over the runs of `keys`, each against the baseline of its own tag found
    among `baselines` (every revision: a method not rerun keeps the baseline it ran beside),
    repeats pooled as the tables pool them, so every revision of a method pools over the same
    tasks; baselines left out."""
    chosen = [run for run in runs if _key(run) in keys]
    tags = {(run.target, run.task, run.tag) for run in chosen}
    bases = [run for run in baselines if run.method == BASELINE and (run.target, run.task, run.tag) in tags]
    groups: dict[tuple, list[RunFile]] = {}
    for run in chosen + bases:  # one group per revision: two baseline revisions never pool
        groups.setdefault((*_key(run), run.revision), []).append(run)
    frame = summarize(Records([kept for group in groups.values() for kept in pool_repeats(group)[0]]), by)
    return frame[frame.method.ne(BASELINE)] if not frame.empty else frame


def revisions_table(records: Records, by: str = "task") -> pd.DataFrame:
    """One row per revision (older ones, then the newest) of every method whose records have a
    superseded revision. by="overall": one row per generation of a method (its settings but the
    task: one drafter), turns pooled over the tasks it covers, labelled by the revisions it ran
    under (a task rerun more often than another numbers the same drafter's cells higher)."""
    keys = {_key(r) for r in records.superseded if r.method != BASELINE}
    if not keys:
        return pd.DataFrame()
    newest = {_key(r): r for r in records.runs}
    every = records.runs + records.superseded
    frames = []
    if by == "task":
        for revision in sorted({r.revision for r in records.superseded}):
            frame = _summary([r for r in records.superseded if r.revision == revision], keys, by, every)
            if frame.empty:
                continue
            frame["records"] = [f"{s}.r{revision}" if revision > 1 else s for s in frame.series]
            old = {_key(r): r for r in records.superseded if r.revision == revision}
            frame["changed"] = [_changed(old[k].settings, newest[k].settings) if k in newest else "no newer revision"
                                for k in zip(frame.target, frame.series, frame.task, frame.method)]
            frames.append(frame.assign(order=revision))
    else:  # pooled: one row per generation (settings less the task), whatever its revision number per task
        generations: dict[tuple, list[RunFile]] = {}
        for run in records.superseded:
            if run.method != BASELINE and _key(run) in keys:
                generations.setdefault((run.target, run.series, run.method, _generation(run)), []).append(run)
        for rank, runs in enumerate(sorted(generations.values(), key=_age)):
            frame = _summary(runs, {_key(r) for r in runs}, by, every)
            if not frame.empty:
                frame["records"] = ", ".join(sorted({r.tag for r in runs}, key=lambda t: (parse_tag(t), t)))
                frames.append(frame.assign(order=rank))
    tags = {(k[0], k[1], k[3]): set() for k in keys}
    for key in keys:
        if key in newest:
            tags[(key[0], key[1], key[3])].add(newest[key].tag)
    current = _summary(records.runs, keys, by, every)
    if current.empty:
        return pd.concat(frames, ignore_index=True).drop(columns="order") if frames else pd.DataFrame()
    current["records"] = [", ".join(sorted(tags[(t, s, m)])) for t, s, m in
                          zip(current.target, current.series, current.method)] if by != "task" else \
        [newest[k].tag for k in zip(current.target, current.series, current.task, current.method)]
    current["changed"] = NEWEST
    frame = pd.concat([*frames, current.assign(order=math.inf)], ignore_index=True)
    order = [c for c in ("target", "series", "task") if c in frame] + ["method", "order"]
    return frame.sort_values(order).drop(columns="order").reset_index(drop=True)


def display_revisions(frame: pd.DataFrame) -> pd.DataFrame:
    """Readable columns: the records (tag revision), the drafter's trained tokens, τ, speedup."""
    if frame.empty:
        return frame
    rows = []
    for _, r in frame.iterrows():
        row = {"target": r["target"]} if frame["target"].nunique() > 1 else {}
        if "task" in frame:
            row["task"] = r["task"]
        speedup, tokens = r.get("speedup", math.nan), r.get("trained_tokens", math.nan)
        low, high = r["speedup_ci"] if isinstance(r.get("speedup_ci"), (tuple, list)) else (math.nan, math.nan)
        row.update({"method": r["method"], "records": r["records"], "turns": int(r["turns"]),
                    "drafter trained on": "-" if pd.isna(tokens) else f"{tokens / 1e6:.2f}M tokens",
                    "τ": "-" if pd.isna(r["tau"]) else f"{r['tau']:.2f}",
                    "speedup [95% CI]": "- (no baseline)" if pd.isna(speedup)
                    else f"{speedup:.2f}x [{low:.2f}, {high:.2f}]"})
        if "task" in frame:  # pooled rows mix tasks whose settings may have changed apart
            row["changed against the newest"] = r["changed"] if isinstance(r.get("changed"), str) else ""
        rows.append(row)
    return pd.DataFrame(rows)
