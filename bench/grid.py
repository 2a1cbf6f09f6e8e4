"""`python -m bench.grid` (`make all-results`): every method x task on one target, through
the same code path as `bench run`, then `bench report` draws it.

Idempotent. A cell (method, task) whose records hold every planned turn and were recorded
with the settings this run would record is skipped. An unfinished one resumes (bench run
skips finished turns). One whose records hold other settings (a retrained drafter, new
defaults, another max_new_tokens) is run again into the next revision of the tag
(`grid.r2`, `grid.r3`, ...), so finished records are never overwritten; the report shows
the newest revision and lists the older ones as superseded. A method that cannot run here
(no trained drafter) is recorded as "not run: <reason>" in the manifest
results/<target>/grid-<tag>.json, which the report reads; the grid goes on.

Default plan (CPU; how long it takes is in results/README.md; the report's bootstrap
intervals show how stable each speedup is): MT-bench
1 question per category (8 questions, 16 turns), HumanEval and GSM8K the first 10,
Spec-Bench 1 per category (13 questions, 21 turns), 128 new tokens, greedy: 57 turns per
method. `--full`:
every question of every suite, 256 new tokens, tag `full`. `--repeats N`: N whole passes of
the grid, one after another (pass k > 1 under tag `<tag>.rep<k>`), so every speedup also
has its spread over passes; already recorded passes are skipped like any finished cell.
`--remeasure-contended`: a method's records with turns that shared the CPU with another job
(bench.report.tables.contended_turns) are moved aside to `<file>.contended[.N]` (kept, not read by
reports) and the cell runs again. `--remeasure-stale`: the same for records that began long
before or after the tag's shared AR baseline (`<file>.stale[.N]`); the cell runs again and,
since that baseline is recorded, re-times each baseline turn right before its own (bench.run).
`--ray auto|ADDRESS`: the cells run as tasks on a Ray cluster
(bench.grid_ray); this process still plans them and writes every file.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import click

from bench.cli_errors import OneLineCommand
from bench.core.errors import BenchError
from bench.core.options import option_pairs
from bench.records import (
    BASELINE,
    RunFile,
    check_tag,
    has_records,
    identity_of,
    record_files,
    records_path,
    revision_tag,
    split_repeat,
    split_revision,
    stored_file,
)
from bench.tune import AUTO, check_tuned_drafter, parse_budget, tuned_budget

SKIPPED_METHODS = {BASELINE: "the baseline: runs beside every method", "hf": "outside reference, not a drafter"}
DEFAULT_PLAN: dict[str, dict] = {"mtbench": {"per_category": 1}, "humaneval": {"limit": 10},
                                 "gsm8k": {"limit": 10}, "specbench": {"per_category": 1}}
DEFAULT_MAX_NEW_TOKENS = 128
FULL_PLAN: dict[str, dict] = {task: {} for task in DEFAULT_PLAN}
FULL_MAX_NEW_TOKENS = 256


@dataclass
class Cell:
    task: str
    method: str
    status: str = "planned"
    records: str = ""  # the tag its records are in (a revision of the grid's tag, with its repeat)
    repeat: int = 1
    expected_turns: int = 0
    turns: int = 0


def grid_methods() -> list[str]:
    """Every lossless drafting method of the registry (new methods join by registering)."""
    from bench.registry import METHODS

    return [name for name, info in METHODS.items() if name not in SKIPPED_METHODS and info.lossless]


def _normalized(settings: dict) -> dict:
    return json.loads(json.dumps(settings))  # as RunFile compares them: read back from JSON


def _first_settings(path: Path) -> dict | None:
    """The settings a record file was started with; None when it has no (readable) header:
    such a file is never appended to, it gets a new revision too."""
    run = RunFile(path)
    return run.headers[0]["settings"] if run.headers else None


def _same(first: dict | None, wanted: dict) -> bool:
    return first is not None and identity_of(first) == identity_of(wanted)


def cell_paths(results_dir: str | Path, target: str, task: str, method: str, tag: str) -> tuple[Path, Path]:
    """(method records, baseline records) of one cell under one tag."""
    return (records_path(Path(results_dir), target, task, method, tag),
            records_path(Path(results_dir), target, task, BASELINE, tag))


def choose_tag(results_dir: str | Path, target: str, task: str, method: str, tag: str, wanted: dict,
               base_wanted: dict) -> str:
    """The first kept revision of `tag` whose files (method and baseline) were recorded with
    exactly the settings this run would record (a missing one of the two is run), else the
    revision after the newest kept one. A revision of which neither file is kept (retired
    from results/, results/ARCHIVE.md) is skipped, not reused: a cell run into it would sit
    below the newest revision, which is the one reports read."""
    folder = records_path(Path(results_dir), target, task, method, tag).parent
    newest = {method: 1, BASELINE: 1}  # each file's newest kept revision
    for name in newest:
        for path in record_files(folder, f"{name}-*"):
            series, revision = split_revision(split_repeat(path.name[len(name) + 1:].split(".jsonl")[0])[0])
            if series == tag:
                newest[name] = max(newest[name], revision)
    last = max(newest.values())
    for revision in range(1, last + 1):
        paths = cell_paths(results_dir, target, task, method, revision_tag(tag, revision))
        exists = [has_records(path) for path in paths]
        # a gap (neither file kept), or the method's own file gone below its newest: never reused
        if revision < last and not any(exists) or revision < newest[method] and not exists[0]:
            continue
        pairs = zip(paths, (wanted, base_wanted), exists)
        if all(not there or _same(_first_settings(path), settings) for path, settings, there in pairs):
            return revision_tag(tag, revision)
    return revision_tag(tag, last + 1)


def _done_keys(path: Path) -> set[tuple[str, int]]:
    """The (question, turn) keys a record file holds (bench.records' rule)."""
    return RunFile(path).keys if has_records(path) else set()


def _set_aside(path: Path, why: str) -> None:
    """Move a record file to `<file>.<why>[.N]`: kept, not read by reports, and its cell runs again."""
    path = stored_file(path) or path  # a packed file is set aside packed
    aside, number = path.with_name(f"{path.name}.{why}"), 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}.{why}.{number}")
    path.rename(aside)


def set_aside_if_contended(path: Path) -> int:
    """Move a record file with contended turns to `<file>.contended[.N]`; returns how many."""
    from bench.report.tables import contended_turns

    if not has_records(path):
        return 0
    slow = len(contended_turns(RunFile(path).pooled))
    if slow:
        _set_aside(path, "contended")
    return slow


def set_aside_if_stale(path: Path, base_path: Path) -> float | None:
    """Move a method's record file that began more than bench.report.tables.BASELINE_AGE_MINUTES from
    its shared baseline file (and whose turns do not carry re-timed baselines) to
    `<file>.stale[.N]`; returns the minutes between them when it did, else None."""
    from bench.report.tables import BASELINE_AGE_MINUTES, baseline_age

    if not has_records(path) or not has_records(base_path):
        return None
    minutes = baseline_age(RunFile(path), RunFile(base_path))
    if minutes is None or abs(minutes) <= BASELINE_AGE_MINUTES:
        return None
    _set_aside(path, "stale")
    return minutes


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # none yet, or unreadable: this run writes a fresh one
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("cells"), list) else {}


def write_manifest(path: Path, manifest: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def run_grid(plan: dict[str, dict], methods: list[str], tag: str, results_dir: str = "results",
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, target_spec: str | None = None,
             device: str | None = None, dtype: str = "auto", data_dir: str | None = None,
             dry_run: bool = False, echo=print, repeats: int = 1, remeasure_contended: bool = False,
             remeasure_stale: bool = False,
             budget: int | str | None = None, ray: str | None = None, ray_cpus_per_cell: int | None = None,
             temperature: float = 0.0, method_options: dict | None = None) -> list[Cell]:
    """Run (or skip, or resume) every cell, `repeats` passes; returns the cells with their status.
    `remeasure_contended` / `remeasure_stale`: set aside a method's records with contended turns /
    recorded long before or after the tag's shared baseline, and run the cell again.
    `method_options`: every method's --option pairs (each selected method must take them).
    `temperature`: every cell's sampling temperature (0: greedy; seeds per turn, as bench run).
    `budget`: every method's --budget (draft tokens verified per round; "auto": each method's own,
    from this machine's `bench tune` record). `ray`: a Ray cluster's
    address (or auto) to run the cells on, `ray_cpus_per_cell` cores each on CPU (bench.grid_ray)."""
    from bench.core.provenance import git_sha
    from bench.core.target import load_target
    from bench.registry import build_decoder, resolve_options
    from bench.run import RunSettings, check_device, record_settings, run
    from tasks import load_task, task_name

    method_options = method_options or {}
    for method in methods:  # a typo, or an option or budget a method cannot take, fails before anything loads
        resolve_options(method, method_options, 1 if budget == AUTO else budget)
    check_device(device)
    if ray:
        from bench.grid_ray import CellJob, RayCells, check_address

        ray = check_address(ray)  # a dead address fails here, before anything loads or is written
    from bench.core.target import default_device, resolve_dtype

    dtype = resolve_dtype(dtype, device or default_device())  # the grid's settings keep what ran
    target = load_target(target_spec, device, dtype)
    base_decoder = build_decoder(BASELINE, target)
    budgets: dict[str, tuple[int | None, dict | None]] = {}  # method: (its budget, the tuning entry for auto)
    for method in methods:
        try:
            budgets[method] = tuned_budget(results_dir, target, method) if budget == AUTO else (budget, None)
        except BenchError as exc:  # not tuned here: its cells say so, the others run
            budgets[method] = (None, {"error": str(exc)})
    manifest_path = Path(results_dir) / target.name / f"grid-{tag}.json"
    cells: list[Cell] = []
    manifest = {"tag": tag, "target": target.name, "plan": plan, "max_new_tokens": max_new_tokens,
                "temperature": temperature, "budget": budget, "options": method_options,
                "methods": methods, "git_sha": git_sha(), "cells": []}

    # A grid over some tasks or methods keeps what other invocations (earlier, or running
    # beside this one on other tasks) said of the rest: the manifest is re-read under a lock
    # at every save.
    touched = {(task_name(task), m, r) for task in plan for m in [*methods, BASELINE] for r in range(1, repeats + 1)}
    cluster = RayCells(ray, device or default_device(), ray_cpus_per_cell) if ray and not dry_run else None
    baselines: list[tuple[Cell, set, Path]] = []  # each baseline row, its turns and its file

    def save() -> None:
        if dry_run:
            return
        import fcntl

        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        with open(manifest_path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            earlier = _read_manifest(manifest_path)
            kept = [c for c in earlier.get("cells", [])
                    if (c.get("task"), c.get("method"), c.get("repeat", 1)) not in touched]
            # "options" are this invocation's; several invocations under one tag (each method at
            # its own options: `make paper-draft`) keep every method's in "method_options".
            manifest.update(plan={**earlier.get("plan", {}), **plan},
                            methods=sorted({*earlier.get("methods", []), *methods}),
                            method_options={**earlier.get("method_options", {}),
                                            **{m: method_options or {} for m in methods}},
                            updated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            cells=kept + [asdict(c) for c in cells])
            write_manifest(manifest_path, manifest)

    def _run_task_cells(task: str, selection: dict, repeat: int) -> None:
        questions = load_task(task, data_dir, selection.get("limit"), (), selection.get("per_category"))
        name = task_name(task)  # a custom .jsonl task is recorded under its stem, as bench run does
        keys = {(q.question_id, t) for q in questions for t in range(1, len(q.turns) + 1)}
        base_tags = set()
        for method in methods:
            cell = Cell(name, method, expected_turns=len(keys), repeat=repeat)
            cells.append(cell)
            own_budget, tuned = budgets[method]
            settings = RunSettings(method=method, task=task, target=target_spec, max_new_tokens=max_new_tokens,
                                   device=device, dtype=dtype, limit=selection.get("limit"),
                                   per_category=selection.get("per_category"), tag=tag, data_dir=data_dir,
                                   results_dir=results_dir, repeat=repeat, budget=own_budget,
                                   budget_from=tuned.get("file") if tuned else None, temperature=temperature,
                                   method_options=dict(method_options))
            try:
                if tuned and "error" in tuned:
                    raise BenchError(tuned["error"])
                decoder = build_decoder(method, target, resolve_options(method, settings.method_options, own_budget))
                if tuned:
                    check_tuned_drafter(tuned, decoder, method)
            except BenchError as exc:  # e.g. no trained drafter for this target
                cell.status = f"not run: {exc}"
                echo(f"[grid] {method} on {name}: {cell.status}")
                save()
                continue
            wanted = _normalized(record_settings(settings, method, target, decoder))
            base_wanted = _normalized(record_settings(settings, BASELINE, target, base_decoder))
            del decoder

            # The revision is chosen on pass 1's files; pass k > 1 is recorded beside it.
            settings.tag = choose_tag(results_dir, target.name, name, method, tag, wanted, base_wanted)
            cell.records = settings.records_tag
            base_tags.add(cell.records)
            method_path, base_path = cell_paths(results_dir, target.name, name, method, cell.records)
            if remeasure_contended and not dry_run and (slow := set_aside_if_contended(method_path)):
                echo(f"[grid] {method} on {name}: {slow} contended turns; {method_path.name} set aside, run again")
            if remeasure_stale and not dry_run and (age := set_aside_if_stale(method_path, base_path)) is not None:
                echo(f"[grid] {method} on {name}: began {abs(age):.0f} min from its AR baseline; "
                     f"{method_path.name} set aside, run again beside a re-timed baseline")
            if keys <= _done_keys(method_path) and keys <= _done_keys(base_path):
                status = "up to date (skipped)"
            elif dry_run:
                status = "to run"
            elif cluster is not None:  # runs later, on a worker; its status when it is back
                echo(f"[grid] {method} on {name} -> {method_path} (queued on Ray)")
                cell.status = "queued"
                cluster.submit(CellJob(settings, questions, {method: method_path, BASELINE: base_path},
                                       {method: wanted, BASELINE: base_wanted}),
                               partial(finish, cell, keys, method_path))
                continue
            else:
                echo(f"[grid] {method} on {name} -> {method_path}")
                try:
                    run(settings)
                    status = "ran"
                except BenchError as exc:  # bad input for this cell: say so, keep going
                    status = f"failed: {exc}"
            finish(cell, keys, method_path, status)
        for base_tag in sorted(base_tags):
            _, base_path = cell_paths(results_dir, target.name, name, BASELINE, base_tag)
            cells.append(Cell(name, BASELINE, records=base_tag, repeat=repeat, expected_turns=len(keys)))
            baselines.append((cells[-1], keys, base_path))
            count_baseline(*baselines[-1])
        save()

    def finish(cell: Cell, keys: set, method_path: Path, status: str) -> None:
        cell.status, cell.turns = status, len(keys & _done_keys(method_path))
        echo(f"[grid] {cell.method} on {cell.task}: {cell.status} ({cell.turns}/{len(keys)} turns, tag {cell.records})")
        save()

    def count_baseline(cell: Cell, keys: set, base_path: Path) -> None:
        cell.turns = len(keys & _done_keys(base_path))
        cell.status = "baseline" if cell.turns == len(keys) else "baseline, to run" if dry_run else "baseline, partial"

    try:
        for repeat in range(1, repeats + 1):
            for task, selection in plan.items():
                _run_task_cells(task, selection, repeat)
        if cluster is not None:
            cluster.run()
            for row in baselines:
                count_baseline(*row)
            save()
    finally:
        if cluster is not None:
            cluster.close()
    return cells


@click.command(cls=OneLineCommand)
@click.option("--full", is_flag=True, help="every question of every suite, 256 new tokens, tag 'full'")
@click.option("--tag", default=None, help="record series (default: grid, or full with --full)")
@click.option("--task", "tasks", multiple=True, help="only these tasks (repeatable)")
@click.option("--method", "methods", multiple=True, help="only these methods (repeatable; default all lossless)")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="first N questions of every task instead")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None)
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
@click.option("--device", default=None)
@click.option("--dtype", default="auto", show_default=True,
              help="auto: bfloat16 where bf16 is native, float32 elsewhere; float32 is the audit series")
@click.option("--data-dir", default=None)
@click.option("--results-dir", default="results", show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="whole passes of the grid (pass k > 1: tag <tag>.rep<k>); speedups get their spread over passes")
@click.option("--remeasure-contended", is_flag=True,
              help="set aside a method's records with turns that shared the CPU with another job, and run it again")
@click.option("--remeasure-stale", is_flag=True,
              help="set aside a method's records the report calls not interleaved (begun long before or after the "
                   "tag's shared AR baseline), and run it again beside a re-timed baseline")
@click.option("--budget", default=None,
              help="every method's draft tokens verified per round (bench run --budget; use its own --tag), "
                   "or auto: each method's fastest on this machine (`bench tune`; default tag <grid>-auto)")
@click.option("--ray", "ray_address", default=None, metavar="auto|ADDRESS",
              help="run the cells as tasks on this Ray cluster (auto: the one `ray start` started here); "
                   "their records come back here")
@click.option("--ray-cpus-per-cell", type=click.IntRange(min=1), default=None,
              help="with --ray: cores (and torch threads) per cell (default: this process's torch threads; 1 on CUDA)")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="sampling temperature of every cell (the sampled series: default tag <grid>-t<T>)")
@click.option("--option", "options", multiple=True,
              help="method option key=value for every selected method (repeatable; use its own --tag)")
@click.option("--dry-run", is_flag=True, help="say what would run; run nothing, write nothing")
def main(full, tag, tasks, methods, limit, max_new_tokens, target, device, dtype, data_dir, results_dir,
         repeats, remeasure_contended, remeasure_stale, budget, ray_address, ray_cpus_per_cell, temperature,
         options, dry_run) -> None:
    """Every method x task (the default target), idempotent; then run `bench report`."""
    check_tag(tag, revision_ok=False)
    plan = dict(FULL_PLAN if full else DEFAULT_PLAN)
    unknown = [t for t in tasks if t not in plan]
    if unknown:
        raise BenchError(f"unknown grid task {', '.join(unknown)} (choose from {', '.join(plan)})")
    plan = {t: ({"limit": limit} if limit else s) for t, s in plan.items() if not tasks or t in tasks}
    budget = parse_budget(budget)
    tag = tag or ("full" if full else "grid") + (f"-t{temperature:g}" if temperature else "") + (
        f"-{AUTO}" if budget == AUTO else "")
    cells = run_grid(plan, list(methods) or grid_methods(), tag, results_dir,
                     max_new_tokens or (FULL_MAX_NEW_TOKENS if full else DEFAULT_MAX_NEW_TOKENS), target,
                     device, dtype, data_dir, dry_run, echo=lambda line: click.echo(line, err=True),
                     repeats=repeats, remeasure_contended=remeasure_contended,
                     remeasure_stale=remeasure_stale, budget=budget, ray=ray_address,
                     ray_cpus_per_cell=ray_cpus_per_cell, temperature=temperature,
                     method_options=option_pairs(options))
    for cell in cells:
        click.echo(f"{cell.task:<10} {cell.method:<10} {cell.records:<8} {cell.turns:>4}/{cell.expected_turns:<4} "
                   f"{cell.status}")


if __name__ == "__main__":
    main()
