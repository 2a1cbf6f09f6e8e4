"""The scaling figure's runs: every drafter one training run kept (`bench train --keep-at`)
and its final one, on the scaling tasks, each under its own tag `scale-<tokens>-<run>`
(<run>: a hash of what fixes the training run, so a later run into the same folder whose
copies saw the same token counts gets tags of its own), greedy, so that `bench report` draws
τ against training tokens and fits the trend, one line per training run.

    python -m scripts.scaling_runs --method eagle3 --method dflash    # then plots/scaling/report.html

A finished run is read back, not run again; each tag has its own AR baseline, against which
every turn is checked for exactness.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import click
from tqdm import tqdm

from bench.core.errors import BenchError

TASKS = ("mtbench", "humaneval")  # the figure's; each run on the grid's sample of its task
# What a drafter manifest's training section holds that is fixed for a whole run (not the steps so far).
RUN_FIELDS = ("max_steps", "batch_size", "lr", "warmup_steps", "seed", "settings", "features", "feature_tokens")


def training_run(manifest: dict) -> str:
    """8 hex digits naming the training run a drafter (a kept copy or the final one) comes from."""
    from bench.training import without_later_defaults

    training = manifest.get("training", {})
    identity = {"method": manifest.get("method"), **{k: training.get(k) for k in RUN_FIELDS}}
    if isinstance(identity["settings"], dict):
        identity["settings"] = without_later_defaults(identity["settings"])
    return hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]


def kept_drafters(out_dir: Path) -> list[tuple[int, Path]]:
    """(trained tokens, folder) of the kept copies and the final drafter in a training
    folder, by the tokens their manifests say they had seen."""
    from bench.core.drafters import MANIFEST, read_manifest

    found = {}
    for folder in [*sorted(Path(out_dir).glob("kept/*-tokens")), Path(out_dir)]:
        if (folder / MANIFEST).exists():
            tokens = read_manifest(folder).get("training", {}).get("tokens_seen")
            if tokens:  # a kept copy, not the training folder, which moves on as training goes on
                found.setdefault(int(tokens), folder)
    return sorted(found.items())


@click.command()
@click.option("--method", "methods", multiple=True, help="a trained method (repeatable)")
@click.option("--task", "tasks", multiple=True, help="default: MT-bench and HumanEval (the figure's)")
@click.option("--out", "out_dirs", multiple=True,
              help="the training folder of each --method, in order (default: bench train's)")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--results-dir", default="results", show_default=True)
@click.option("--report", "report_dir", default="plots/scaling", show_default=True,
              help="where the report of these runs goes (the scaling figure and its fit)")
@click.option("--compare-tag", "compare", multiple=True,
              help="another series to show in that report, e.g. earlier drafters run the same way")
@click.option("--report-only", is_flag=True,
              help="run nothing: the report of every scaling run kept in --results-dir (where the training "
                   "folders are gone, e.g. on another machine)")
def main(methods, tasks, out_dirs, max_new_tokens, results_dir, report_dir, compare, report_only) -> None:
    try:
        if report_only:
            click.echo(f"report: {_report(results_dir, report_dir, tasks, methods, (), compare)['html']}")
            return
        if not methods:
            raise BenchError("give --method (a trained method), or --report-only")
        _scaling_runs(methods, tasks, out_dirs, max_new_tokens, results_dir, report_dir, compare)
    except BenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _scaling_runs(methods, tasks, out_dirs, max_new_tokens, results_dir, report_dir, compare=()) -> None:
    import methods as _registered  # noqa: F401  (the shipped drafters and data)
    from bench.core.drafters import user_dir
    from bench.core.target import load_target
    from bench.run import RunSettings, run

    if out_dirs and len(out_dirs) != len(methods):
        raise BenchError("--out: one training folder per --method")
    target = load_target()
    plan = []
    for i, method in enumerate(methods):
        folder = Path(out_dirs[i]) if out_dirs else user_dir(target.name, method)
        drafters = kept_drafters(folder)
        if len(drafters) < 2:
            raise BenchError(f"{folder}: fewer than two drafters of different training sizes (bench train --keep-at)")
        for task in tasks or TASKS:
            for tokens, drafter in drafters:
                plan.append((method, task, tokens, drafter))
    from bench.core.drafters import read_manifest
    from bench.grid import DEFAULT_PLAN
    from bench.records import scaling_tag

    tag_of = {drafter: scaling_tag(tokens, training_run(read_manifest(drafter))) for _, _, tokens, drafter in plan}
    for method, task, _, drafter in tqdm(plan, desc="scaling runs"):
        settings = RunSettings(method=method, task=task, max_new_tokens=max_new_tokens, tag=tag_of[drafter],
                               results_dir=results_dir, method_options={"drafter": str(drafter.resolve())},
                               **DEFAULT_PLAN.get(task, {"limit": 10}))
        run(settings)  # a finished record is read back, not run again
    click.echo(f"report: {_report(results_dir, report_dir, tasks, methods, tuple(tag_of.values()), compare)['html']}")


def _report(results_dir, report_dir, tasks, methods, tags, compare) -> dict:
    """The scaling report of `tags` and of every scaling run kept in results_dir, not only this
    call's, so that the report of one method's runs keeps the other methods' lines."""
    from bench.records import record_files
    from bench.report.build import make_report

    files = record_files(Path(results_dir), "*/*/*-scale-*")
    if not files and not tags:
        raise BenchError(f"no scaling runs in {results_dir} (make scaling-runs)")
    kept = {tuple(p.stem.split("-scale-", 1)) for p in files}
    tags = tuple(sorted(set(tags) | {f"scale-{rest}" for _, rest in kept})) + tuple(compare)
    return make_report(Path(results_dir), Path(report_dir),
                       tasks=tuple(sorted(set(tasks or TASKS) | {p.parent.name for p in files})),
                       methods=("ar", *sorted(set(methods) | {m for m, _ in kept} - {"ar"})), tags=tags)


if __name__ == "__main__":
    main()
