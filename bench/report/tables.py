"""Run records -> tables (Markdown, LaTeX, CSV): what `bench report` and `bench.report.summary` show.

Records are read by bench.records' one rule: a line left out (corrupt, malformed, a
duplicate turn), an unfinished last line, a file with no finished turn, a method without its
baseline, a run that covers fewer turns than its baseline or than the grid planned: each
becomes a `Problem` listed in the report, never a silent drop and never a crash. Every
number is computed by bench.metrics from the kept turn records.

Series and revisions (the tag grammar: bench.records): a record file is
`<method>-<tag>.jsonl`. A tag `X.rN` is revision N of series X (bench.grid starts one when
settings or drafter changed, instead of touching finished records); per (task, method) a
report shows the newest revision and lists the older ones as superseded. A method's speedup
is always against the AR baseline of the same tag, i.e. the run it was interleaved with.
Repeats (`X.rep2`, `X.r2.rep3`) of the newest revision recorded with the same settings are
pooled, each turn paired within its own repeat, and the tables give the speedup's spread over
repeats beside its bootstrap interval.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pandas as pd

from bench import metrics
from bench.core.errors import BenchError
from bench.records import (
    BASELINE,
    Problem,
    RunFile,
    pairing_difference,
    parse_tag,
    pool_repeats,
    read_run,
    record_files,
    scaling_run,
    scaling_tokens,
)
from bench.specbench import speedup_specbench

CATEGORY_TASKS = ("mtbench", "specbench", "speedbench")  # suites whose categories get their own tables


@dataclass
class Records:
    runs: list[RunFile]  # the newest revision per (target, task, method, series)
    problems: list[Problem] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)
    manifests: list[dict] = field(default_factory=list)
    superseded: list[RunFile] = field(default_factory=list)
    tunings: list[dict] = field(default_factory=list)  # `bench tune` records (results/<target>/tune/)

    def turns_frame(self) -> pd.DataFrame:
        """One row per turn of the runs in the tables (tables/turns.csv): the raw numbers
        behind every pooled figure, for whoever wants other statistics."""
        rows = []
        for run in self.runs:
            for record in run.pooled:
                util = record.get("utilization") or {}
                accepted = record["accept_lengths"]  # null in an imported turn that could not split them
                rounds = len(accepted) if accepted is not None else math.nan
                rows.append({"target": run.target, "task": run.task, "tag": run.tag, "method": run.method,
                             "repeat": run.repeat, "question_id": record["question_id"].split("/", 1)[1],
                             "category": record.get("category", ""), "turn": record["turn"],
                             "tokens": metrics.new_tokens(record), "ttft_s": record["ttft"],
                             "decode_s": record["decode_time"], "draft_s": record["draft_time"],
                             "verify_s": record["verify_time"], "rounds": rounds,
                             "tau": (sum(accepted) + rounds) / rounds if accepted else math.nan,
                             "exact_match": record.get("exact_match"), "near_tie": record.get("near_tie"),
                             "util_kind": util.get("kind"), "util_mean": util.get("util_mean")})
        return pd.DataFrame(rows)


def _selected(value: str, wanted: tuple[str, ...] | None) -> bool:
    return not wanted or value in wanted


class Shelf:
    """A results folder as one report reads it: every record file, profile, tuning and grid
    manifest read at most once, however many selections (`select`) the report makes."""

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = Path(results_dir)
        if not self.results_dir.is_dir():
            raise BenchError(f"results folder not found: {self.results_dir}")
        self._targets: dict[Path, tuple[list[dict], list[dict], list[dict], list[Problem]]] = {}
        self._runs: dict[Path, tuple[RunFile | None, list[Problem]]] = {}

    def _target(self, target_dir: Path) -> tuple[list[dict], list[dict], list[dict], list[Problem]]:
        if target_dir not in self._targets:
            problems: list[Problem] = []
            self._targets[target_dir] = (_read_profiles(target_dir, problems), _read_tunings(target_dir, problems),
                                         _read_manifests(target_dir, problems), problems)
        return self._targets[target_dir]

    def _run(self, path: Path) -> tuple[RunFile | None, list[Problem]]:
        if path not in self._runs:
            problems: list[Problem] = []
            self._runs[path] = read_run(path, problems), problems
        return self._runs[path]

    def select(self, targets: tuple[str, ...] | None = None, tasks: tuple[str, ...] | None = None,
               methods: tuple[str, ...] | None = None, tags: tuple[str, ...] | None = None) -> Records:
        """The records of every file under results/<target>/<task>/ that the filters select.
        `tags` select series: "grid" also takes its revisions grid.r2, grid.r3 ..."""
        problems: list[Problem] = []
        found: dict[tuple[str, str, str, str], list[RunFile]] = {}
        target_dirs = [d for d in sorted(self.results_dir.iterdir()) if _selected(d.name, targets)
                       and _is_target_dir(d)]
        if targets:
            for name in set(targets) - {d.name for d in target_dirs}:
                problems.append(Problem("missing", str(self.results_dir / name), "no records for this target"))
        profiles, manifests, tunings, seen = [], [], [], 0
        for target_dir in target_dirs:
            target_profiles, target_tunings, target_manifests, target_problems = self._target(target_dir)
            profiles += target_profiles
            tunings += target_tunings
            manifests += [m for m in target_manifests if _selected(m["tag"], tags)]
            problems += target_problems
            for task_dir in sorted(d for d in target_dir.iterdir() if d.is_dir()):
                if not _selected(task_dir.name, tasks):
                    continue
                for path in record_files(task_dir):
                    method, _, tag = path.stem.partition("-")  # a file left out still counts as seen
                    run, file_problems = self._run(path)
                    method, series = (run.method, run.series) if run else (method, parse_tag(tag)[0])
                    if not _selected(method, methods) or not _selected(series, tags):
                        continue
                    seen += 1
                    problems += file_problems
                    if run is not None:
                        found.setdefault((run.target, run.task, run.method, run.series), []).append(run)
        runs, superseded = [], []
        for revisions in found.values():
            revisions.sort(key=lambda r: (r.revision, r.repeat))
            newest = revisions[-1].revision
            kept, mixed = pool_repeats([r for r in revisions if r.revision == newest])  # with its repeats
            runs += kept
            problems += mixed
            for old in revisions:
                if old.revision != newest:
                    superseded.append(old)
                    problems.append(Problem("superseded", str(old.path), "an older revision of the series (other "
                                            f"settings); the tables use {kept[0].path.name}"))
        runs.sort(key=lambda r: (r.target, r.task, r.series, r.method != BASELINE, r.method, r.repeat))
        if not seen:
            where = ", ".join(f"{k} {' '.join(v)}" for k, v in (("target", targets), ("task", tasks),
                                                               ("method", methods), ("tag", tags)) if v)
            raise BenchError(f"no run records under {self.results_dir}" + (f" for {where}" if where else ""))
        records = Records(runs, problems, profiles, manifests, superseded, tunings)
        # an older revision that a kept run was interleaved with is its baseline, not a leftover
        bases = {str(base.path) for run in runs if (base := _base_for(records, run)) in superseded}
        records.problems = [p for p in problems if not (p.kind == "superseded" and p.where in bases)]
        _check_coverage(records)
        _check_pairing(records)
        _check_contention(records)
        _check_baseline_age(records)
        return records


def load_records(results: Path | Shelf, targets: tuple[str, ...] | None = None,
                 tasks: tuple[str, ...] | None = None, methods: tuple[str, ...] | None = None,
                 tags: tuple[str, ...] | None = None) -> Records:
    """`Shelf.select` of a results folder (or of a shelf already read)."""
    shelf = results if isinstance(results, Shelf) else Shelf(results)
    return shelf.select(targets, tasks, methods, tags)


def _is_target_dir(folder: Path) -> bool:
    """results/<target>/ holds task folders of .jsonl records or a profile (results/gpu/ does not)."""
    return folder.is_dir() and (any(record_files(folder, "*/*")) or (folder / "profile").is_dir())


def _read_profiles(target_dir: Path, problems: list[Problem]) -> list[dict]:
    """`bench profile` outputs (results/<target>/profile/<device>-<dtype>-<machine>-t<threads>.json);
    the folder's other records (scripts' A/B runs: kernels-ab-, train-ab-, omp-wait-, ...) are
    not profiles and are left alone."""
    profiles = []
    folder = target_dir / "profile"
    for path in sorted([*folder.glob("cpu-*.json"), *folder.glob("cuda-*.json")]):
        try:
            profile = json.loads(path.read_text(encoding="utf-8"))
            rows = profile["rows"]
            if not all({"kind", "k", "median_s"} <= set(row) for row in rows):
                raise KeyError("rows")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append(Problem("corrupt", str(path), f"unreadable hardware profile ({type(exc).__name__})"))
            continue
        profiles.append({**profile, "path": str(path), "target": profile.get("target", target_dir.name)})
    if not profiles:
        problems.append(Problem("missing", str(target_dir / "profile"),
                                f"no hardware profile: run `bench profile --target {target_dir.name}`"))
    return profiles


def _read_tunings(target_dir: Path, problems: list[Problem]) -> list[dict]:
    """`bench tune` records (results/<target>/tune/<device>-<dtype>-<machine>-t<threads>.json)."""
    tunings = []
    for path in sorted((target_dir / "tune").glob("*.json")):
        try:
            tuning = json.loads(path.read_text(encoding="utf-8"))
            rows = [row for entry in tuning["methods"].values() for row in entry["candidates"]]
            if not all({"budget", "speedup"} <= set(row) for row in rows):
                raise KeyError("candidates")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            problems.append(Problem("corrupt", str(path), f"unreadable tuning record ({type(exc).__name__})"))
            continue
        tunings.append({**tuning, "path": str(path)})
    return tunings


def _read_manifests(target_dir: Path, problems: list[Problem]) -> list[dict]:
    """Grid manifests (bench.grid): what was planned, and which cells could not run."""
    manifests = []
    for path in sorted(target_dir.glob("grid-*.json")):
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            manifest["cells"], manifest["tag"]  # noqa: B018 - both must be there
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append(Problem("corrupt", str(path), f"unreadable grid manifest ({type(exc).__name__})"))
            continue
        manifests.append({**manifest, "path": str(path), "target": target_dir.name})
    return manifests


def _check_coverage(records: Records) -> None:
    """Partial runs: fewer turns than the baseline or the grid's plan; second turns missing;
    methods without a baseline; grid cells that did not run."""
    by_key = {(r.target, r.task, r.series, r.method, r.repeat): r for r in records.runs}
    for run in records.runs:
        where = str(run.path)
        keys = {(t["question_id"], t["turn"]) for t in run.pooled}
        if run.method != BASELINE:
            base = _base_for(records, run)
            newest = by_key.get((run.target, run.task, run.series, BASELINE, run.repeat))
            if base is None and newest is not None and newest.tag != run.tag:
                records.problems.append(Problem("no baseline", where, f"its baseline revision {BASELINE}-{run.tag} "
                                                f"is missing (newest is {newest.path.name}): no speedup"))
            elif base is None:
                records.problems.append(Problem("no baseline", where, f"no {BASELINE}-{run.tag or '(untagged)'} "
                                                "records beside it: no speedup"))
            else:
                base_keys = {(t["question_id"], t["turn"]) for t in base.pooled}
                if base_keys - keys:
                    records.problems.append(Problem(
                        "partial", where, f"{len(keys & base_keys)} of the {len(base_keys)} turns its baseline has; "
                        "speedup over the shared turns only"))
        first_turns = {q for q, t in keys if t == 1}
        turn_counts = {q: sum(1 for k in keys if k[0] == q) for q in first_turns}
        if run.task == "mtbench":
            halves = sorted(q.split("/", 1)[1] for q, n in turn_counts.items() if n < 2)
            if halves:
                records.problems.append(Problem("partial", where, f"MT-bench questions with turn 1 only: "
                                                f"{', '.join(halves[:10])}" + (" ..." if len(halves) > 10 else "")))
    for manifest in records.manifests:
        for cell in manifest["cells"]:
            status = cell.get("status", "")
            where = f"{manifest['path']}: {cell.get('method')} on {cell.get('task')}"
            if status.startswith(("not run", "failed")):
                records.problems.append(Problem("not run", where, status))
            run = by_key.get((manifest["target"], cell.get("task"), manifest["tag"], cell.get("method"),
                              cell.get("repeat", 1)))
            expected = cell.get("expected_turns")
            if run is not None and expected and len(run.pooled) < expected:
                records.problems.append(Problem("partial", str(run.path),
                                                f"{len(run.pooled)} of the {expected} turns the grid planned"))


# A CPU turn whose process got less than this share of the CPU its threads got elsewhere in
# the same run shared the cores with another job: its times are slower than the method is.
CONTENDED_SHARE = 0.85


def contended_turns(turns: list[dict]) -> list[dict]:
    """CPU turns that ran short of CPU. Utilization is process CPU time over wall time, per
    core; the share a turn should get is the most any turn of the same run got with the same
    torch threads, or threads/cpus where the record says both (newer records)."""
    measured = []  # (turn, its utilization %, its torch threads)
    best: dict[object, float] = {}
    for turn in turns:
        util = turn.get("utilization") or {}
        if util.get("kind") != "cpu" or util.get("util_mean") is None:
            continue
        threads = util.get("threads", turn.get("_threads"))
        expected = 100.0 * min(threads, util["cpus"]) / util["cpus"] if threads and util.get("cpus") else 0.0
        best[threads] = max(best.get(threads, 0.0), util["util_mean"], expected)
        measured.append((turn, util["util_mean"], threads))
    return [turn for turn, share, threads in measured if share < CONTENDED_SHARE * best[threads]]


def _check_contention(records: Records) -> None:
    for run in records.runs:
        slow = contended_turns(run.pooled)
        if slow:
            shown = ", ".join(f"{t['question_id'].split('/', 1)[1]}/{t['turn']}" for t in slow[:8])
            records.problems.append(Problem(
                "contended", str(run.path), f"{len(slow)} of {len(run.pooled)} turns got under "
                f"{CONTENDED_SHARE:.0%} of the CPU their threads got elsewhere in the run (another job shared the "
                f"cores): their times, and the speedups that use them, read slow ({shown}"
                + (" ..." if len(slow) > 8 else "") + ")"))


BASELINE_AGE_MINUTES = 45  # a grid of every method runs a task's cells within about half an hour


def _started(run: RunFile) -> datetime | None:
    """When the run's records began (its first header), or None where not recorded."""
    stamp = (run.headers[0].get("provenance") or {}).get("started_at") if run.headers else None
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ") if stamp else None
    except (TypeError, ValueError):
        return None


def baseline_age(run: RunFile, base: RunFile | None) -> float | None:
    """Minutes from the start of a method's baseline file to the start of its own, where its
    speedup rests on that file; None where every turn carries its own re-timed baseline
    (`paired_baseline`, bench.run) or a start is not recorded."""
    if base is None or all(t.get("paired_baseline") for t in run.pooled):
        return None
    mine, theirs = _started(run), _started(base)
    return None if mine is None or theirs is None else (mine - theirs).total_seconds() / 60


def _check_baseline_age(records: Records) -> None:
    """A method whose baseline was recorded long before or after it (the baseline is shared
    by a tag's cells, interleaved with the first; runs since the paired baseline re-time it
    per turn instead): the machine may have changed in between, and its speedup compares two
    moments of it, not two methods. A re-timed baseline that decoded other tokens than the
    recorded one is reported too."""
    for run in records.runs:
        base = _base_for(records, run)
        differ = [t for t in run.pooled if t.get("paired_baseline") and not t["paired_baseline"]["same_tokens"]]
        if differ:
            records.problems.append(Problem(
                "baseline not reproduced", str(run.path), f"{len(differ)} of its turns' re-timed AR baselines "
                f"decoded other tokens than the AR records hold (first: {differ[0]['question_id']} turn "
                f"{differ[0]['turn']}): the baseline is not deterministic here"))
        minutes = baseline_age(run, base)
        if minutes is not None and abs(minutes) > BASELINE_AGE_MINUTES:
            when = "after" if minutes > 0 else "before"
            records.problems.append(Problem(
                "not interleaved", str(run.path), f"began {abs(minutes):.0f} min {when} its AR baseline "
                f"{base.path.name} (over {BASELINE_AGE_MINUTES}): its speedup compares the machine at two moments; "
                "`python -m bench.grid --remeasure-stale` runs it again, re-timing the baseline beside it"))


# ---------------------------------------------------------------- metrics per run / group


def _util(turns: list[dict], kind: str) -> float:
    values = [(t.get("utilization") or {}).get("util_mean") for t in turns
              if (t.get("utilization") or {}).get("kind") == kind]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _per_round(turns: list[dict], key: str) -> float:
    turns = metrics.known(turns, key, "accept_lengths")
    rounds = sum(len(t["accept_lengths"]) for t in turns)
    return sum(t[key] for t in turns) / rounds if rounds else float("nan")


def summarize_group(method: list[dict], base: list[dict] | None) -> dict:
    """bench.metrics.summarize (τ, a_i, speedup with its interval, the speedup model) plus
    the columns a report adds: draft budget, verify time per round, utilization."""
    row = metrics.summarize(method, base if base else None)
    if base:  # beside ours, the other convention (bench.specbench): ratio of mean per-question tok/s
        row["speedup_specbench"] = speedup_specbench(method, base)
    sized = metrics.known(method, "tree_sizes")
    rounds = sum(len(t["tree_sizes"]) for t in sized)
    row.update(questions=len({t["question_id"] for t in method}),
               tree_size=sum(sum(t["tree_sizes"]) for t in sized) / rounds if rounds else float("nan"),
               verify_s_per_round=_per_round(method, "verify_time"),
               # Mean requests sharing a target pass (1 for batch-1 runs): total throughput ~ tok/s x load.
               load=sum(t.get("load", 1.0) for t in method) / len(method) if method else float("nan"),
               gpu_util=_util(method, "gpu"), cpu_util=_util(method, "cpu"))
    return row


def _drafter_run(series: str, drafter: dict) -> str | None:
    """The training run a drafter comes from: the run a scaling series names (a hash of what
    fixes the run, so a run's kept copies and its final drafter, shipped elsewhere, share it,
    and a later run into the same folder does not), else its folder (whose copies kept at N
    tokens sit in kept/<N>-tokens/)."""
    run = scaling_run(series)
    if run:
        return run
    return re.sub(r"/kept/\d+-tokens/?$", "", str(drafter.get("drafter", ""))) or None


def _shipped_trained_tokens(method: str, digest: str | None) -> int | None:
    """Tokens the shipped drafter with this weights digest was trained on, from its manifest:
    MTP's and SpS's records carry the digest but not the count (Medusa's neither)."""
    return _shipped_tokens_by_digest(method).get(digest) if digest else None


@functools.cache
def _shipped_tokens_by_digest(method: str) -> dict[str, int]:
    import methods  # noqa: F401  (registers the shipped drafters)
    from bench.core.drafters import list_drafters, read_manifest, weights_sha1

    found = {}
    for _, name, kind, folder in list_drafters():
        if name != method or kind != "shipped":
            continue
        tokens = read_manifest(folder).get("training", {}).get("tokens_seen")
        if tokens is not None and (digest := weights_sha1(folder)):
            found[digest] = int(tokens)
    return found


def _drafter_id(drafter: dict) -> str | None:
    """Which drafter ran: its weights' digest where the method records one, else its export
    (time and trained tokens: `bench ship` adds keys to the manifest it copies, so a shipped
    drafter's manifest digest is not its training folder's), else its manifest's digest."""
    if drafter.get("weights_sha1"):
        return drafter["weights_sha1"]
    if drafter.get("exported_at"):
        return f"{drafter['exported_at']}/{drafter.get('trained_tokens')}"
    return drafter.get("manifest_sha")


def _base_for(records: Records, run: RunFile) -> RunFile | None:
    """The baseline run of the same tag: a method not yet rerun into a newer revision keeps
    the baseline it was interleaved with, though that baseline's newer revision is shown."""
    if run.method == BASELINE:
        return None
    base = next((r for r in records.runs + records.superseded if (r.target, r.task, r.tag, r.method) ==
                 (run.target, run.task, run.tag, BASELINE)), None)
    if base is None or pairing_difference(run.settings, base.settings):  # never paired across settings
        return None
    return base


def _check_pairing(records: Records) -> None:
    """Each method run against its baseline (same tag) as `bench check` checks it: other settings
    (not paired), contradicted exact-match flags, greedy turns of another prompt."""
    from bench.check import pair_findings

    for run in records.runs:
        if run.method == BASELINE:
            continue
        base = next((r for r in records.runs + records.superseded if (r.target, r.task, r.tag, r.method) ==
                     (run.target, run.task, run.tag, BASELINE)), None)
        if base is not None:
            records.problems += pair_findings(run, base)


def summarize(records: Records, by: str = "task") -> pd.DataFrame:
    """One row per (target, series, method[, task | category]).
    by: "task" (a row per run), "overall" (turns pooled over tasks), "category"
    (MT-bench and Spec-Bench split by question category)."""
    names = {"task": ["target", "series", "task", "method"], "overall": ["target", "series", "method"],
             "category": ["target", "series", "task", "category", "method"]}[by]
    groups: dict[tuple, dict] = {}
    for run in records.runs:
        if by == "category" and run.task not in CATEGORY_TASKS:
            continue
        base = _base_for(records, run)
        parts = [(c, [t for t in run.pooled if t.get("category", "") == c])
                 for c in sorted({t.get("category", "") for t in run.pooled})] if by == "category" \
            else [("", run.pooled)]
        for category, turns in parts:
            values = {"target": run.target, "series": run.series, "task": run.task, "category": category,
                      "method": run.method}
            drafter = run.settings.get("drafter") if isinstance(run.settings.get("drafter"), dict) else {}
            group = groups.setdefault(tuple(values[n] for n in names), {
                "method": [], "base": [], "tasks": set(), "budget": run.draft_budget,
                # Not every method's records carry it (MTP, SpS, Medusa): then the shipped drafter's
                # of the same weights, else the scaling tag's count.
                "trained_tokens": drafter.get("trained_tokens") or (
                    None if run.method == BASELINE else
                    _shipped_trained_tokens(run.method, drafter.get("weights_sha1")) or scaling_tokens(run.series)),
                "drafter_run": _drafter_run(run.series, drafter),
                "drafter_weights": drafter.get("weights_sha1"),
                "drafter_id": _drafter_id(drafter),
                "oracle_accept": (run.settings.get("method_options") or {}).get("oracle_accept"),
                "batch_size": run.settings.get("batch_size", 1)})
            group["method"] += turns
            group["tasks"].add(run.task)
            if base is not None:  # pooled over tasks: a task without a baseline adds no pairs
                group["base"] += base.pooled
    rows = []
    for key, group in groups.items():
        row = dict(zip(names, key))
        row["tasks"] = ", ".join(sorted(group["tasks"]))
        # Draft tokens verified per round as run (--budget, or read from the options): NaN where not fixed.
        row["budget"] = float("nan") if group["budget"] is None else group["budget"]
        # Tokens the run's drafter was trained on (`bench train` records it; NaN for older drafters).
        row["trained_tokens"] = float("nan") if group["trained_tokens"] is None else group["trained_tokens"]
        row["drafter_run"] = group["drafter_run"]
        row["drafter_weights"] = group["drafter_weights"]  # the weights' digest, where the method records it
        row["drafter_id"] = group["drafter_id"]  # which drafter ran: that digest, else its manifest's
        # The oracle's per-node acceptance where the run replaced the drafts (bench.core.oracle); NaN: real drafts.
        row["oracle_accept"] = float("nan") if group["oracle_accept"] is None else group["oracle_accept"]
        row["batch_size"] = group["batch_size"]  # requests decoding at once (bench run --batch-size)
        row.update(summarize_group(group["method"], group["base"] or None))
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame["_order"] = frame["method"].ne(BASELINE)
    sort = [c for c in names if c != "method"] + ["_order", "method"]
    return frame.sort_values(sort).drop(columns="_order").reset_index(drop=True)


# ---------------------------------------------------------------- tables


def _num(value: float, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value * scale, fmt)


def display_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Human-readable columns for Markdown / LaTeX / HTML; CSV keeps the raw numbers."""
    if frame.empty:
        return frame
    keys = [c for c in ("target", "series") if frame[c].nunique() > 1]  # constant columns say nothing
    keys += [c for c in ("task", "category") if c in frame]
    if "task" not in frame and frame["tasks"].nunique() > 1:
        keys.append("tasks")
    show_gpu = frame["gpu_util"].notna().any()
    show_repeats = "speedup_repeats" in frame and any(isinstance(v, list) and len(v) > 1
                                                       for v in frame["speedup_repeats"])
    rows = []
    for _, r in frame.iterrows():
        row = {("tag" if k == "series" else k): r[k] for k in keys}
        row["method"] = r["method"]
        row["turns"] = int(r["turns"])
        row["τ"] = _num(r["tau"], ".2f")
        if r["method"] == BASELINE:
            row["speedup [95% CI]"] = "1 (baseline)"
        elif isinstance(r.get("speedup_ci"), (tuple, list)) and not math.isnan(r.get("speedup", math.nan)):
            low, high = r["speedup_ci"]
            row["speedup [95% CI]"] = f"{r['speedup']:.2f}x [{_num(low, '.2f')}, {_num(high, '.2f')}]"
        else:
            row["speedup [95% CI]"] = "- (no baseline)"
        if show_repeats:
            row["speedup over repeats"] = _repeat_spread(r.get("speedup_repeats"), r["method"])
        # Spec-Bench's convention (bench.specbench): the ratio of mean per-question tok/s, same turns.
        specbench = _num(r.get("speedup_specbench", math.nan), ".2f")
        row["speedup (Spec-Bench)"] = "1 (baseline)" if r["method"] == BASELINE else \
            specbench + ("x" if specbench != "-" else "")
        row["tok/s"] = _num(r["tokens_per_s"], ".1f")
        # the AR rate its speedup is against (the same turns, interleaved): they may differ from the AR row's
        beside = r.get("base_tokens_per_s", math.nan)
        row["AR tok/s beside it"] = "-" if r["method"] == BASELINE else _num(beside, ".1f")
        row["TTFT ms"] = _num(r["ttft_s"], ".0f", 1e3)
        row["TPOT ms"] = _num(r["tpot_s"], ".1f", 1e3)
        if r["method"] == BASELINE:
            row["exact match"] = "reference"
        else:
            match = _num(r["match_rate"], ".0f", 100)
            row["exact match"] = "-" if match == "-" else (
                f"{match}%" + (f" ({r['near_ties']} near ties, {r['mismatches']} mismatches)"
                               if r["near_ties"] or r["mismatches"] else ""))
        if show_gpu:
            row["GPU util"] = _num(r["gpu_util"], ".0f") + ("%" if not math.isnan(r["gpu_util"]) else "")
        rows.append(row)
    return pd.DataFrame(rows)


def _repeat_spread(values: object, method: str) -> str:
    """"median [min, max] (n repeats)" of the per-repeat speedups."""
    if method == BASELINE:
        return "-"
    if not isinstance(values, list) or not values:
        return "- (no baseline)"
    median, least, most = metrics.spread(values)
    if len(values) == 1:
        return f"{_num(median, '.2f')}x (1 pass)"
    return f"{_num(median, '.2f')}x [{_num(least, '.2f')}, {_num(most, '.2f')}] ({len(values)} passes)"


def csv_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Raw numbers: lists (acceptance, histogram) as JSON, the CI as two columns."""
    out = frame.copy()
    if out.empty:
        return out
    ci = out.pop("speedup_ci") if "speedup_ci" in out else None
    if ci is not None:
        out["speedup_ci_low"] = [c[0] if isinstance(c, (tuple, list)) else math.nan for c in ci]
        out["speedup_ci_high"] = [c[1] if isinstance(c, (tuple, list)) else math.nan for c in ci]
    for column in ("accept_uncond", "accept_cond", "accept_hist", "speedup_repeats"):
        if column in out:
            out[column] = [json.dumps(v) for v in out[column]]
    return out


def to_markdown(table: pd.DataFrame) -> str:
    if table.empty:
        return "(no rows)"
    escape = lambda v: str(v).replace("|", "\\|")  # noqa: E731 - a cell must not end the row
    lines = ["| " + " | ".join(map(escape, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(map(escape, row)) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex(value: object) -> str:
    """A cell or header as LaTeX text (one pass, so escapes are not escaped again; τ as math)."""
    return re.sub(r"[\\&%$#_{}~^]", lambda m: _TEX[m.group()], str(value)).replace("τ", r"$\tau$")


def to_latex(table: pd.DataFrame, caption: str) -> str:
    if table.empty:
        return f"% {caption}: no rows\n"
    cells = table.map(_tex).rename(columns=_tex)
    return cells.to_latex(index=False, escape=False, caption=_tex(caption), column_format="l" * len(table.columns))


@dataclass
class Tables:
    overall: pd.DataFrame
    per_task: pd.DataFrame
    per_category: pd.DataFrame


def build_tables(records: Records) -> Tables:
    return Tables(summarize(records, "overall"), summarize(records, "task"), summarize(records, "category"))


def write_tables(tables: Tables, out: Path, records: Records | None = None) -> list[Path]:
    """tables/{overall,per_task,per_category}.{md,tex,csv}, and tables/turns.csv."""
    folder = Path(out) / "tables"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, frame in (("overall", tables.overall), ("per_task", tables.per_task),
                        ("per_category", tables.per_category)):
        shown = display_table(frame)
        for suffix, text in (("md", to_markdown(shown) + "\n"),
                             ("tex", to_latex(shown, f"{name.replace('_', ' ')} (bench report)")),
                             ("csv", csv_table(frame).to_csv(index=False))):
            path = folder / f"{name}.{suffix}"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    if records is not None:
        written.append(folder / "turns.csv")
        records.turns_frame().to_csv(written[-1], index=False)
    return written


# ---------------------------------------------------------------- README

# README.md keeps the headline (`bench report`'s pooled table) and the shipped drafters' table; every
# other generated block (references, tuned, revisions, grid, blocks, peers, audit, ...) lives in
# results/README.md.
HEADLINE = "report"
RESULTS_README = Path("results") / "README.md"


def replace_between_markers(text: str, name: str, block: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise BenchError(f"README needs exactly one '{start}' ... '{end}' pair")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block.strip()}\n{end}{tail}"


def update_readmes(files: dict[Path, dict[str, str]]) -> None:
    """Rewrite the named blocks of several Markdown files; every file's markers are checked
    before any file is written, so a missing marker leaves them all as they were."""
    texts = {}
    for readme, blocks in files.items():
        try:
            text = Path(readme).read_text(encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"cannot read {readme}: {exc.strerror}") from None
        for name, block in blocks.items():
            try:
                text = replace_between_markers(text, name, block)
            except BenchError as exc:
                raise BenchError(f"{readme}: {exc}") from None
        texts[Path(readme)] = text
    for readme, text in texts.items():
        tmp = readme.with_suffix(".tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(readme)
        except OSError as exc:  # a full disk or a read-only folder: the file stays as it was
            tmp.unlink(missing_ok=True)
            raise BenchError(f"cannot write {readme}: {exc.strerror}") from None


def update_readme(readme: Path, blocks: dict[str, str]) -> None:
    update_readmes({Path(readme): blocks})
