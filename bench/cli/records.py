"""`bench check`, `bench pack`, `bench import`, `bench export`: record files and published layouts."""

from __future__ import annotations

import sys

import click

from bench.core.errors import BenchError


@click.command(name="check")
@click.argument("results_dir", default="results")
@click.option("--notes/--no-notes", default=False, show_default=True, help="also list what only describes a series")
def check_cmd(results_dir, notes) -> None:
    """Read every record file under RESULTS_DIR and name, per file, what is malformed,
    duplicated, foreign, unpaired or inconsistent; exit 1 if anything is (bench/check.py)."""
    from pathlib import Path

    from bench.check import DAMAGE, check, summary

    if not Path(results_dir).is_dir():
        raise BenchError(f"results folder not found: {results_dir}")
    damaged, described = summary(check(Path(results_dir)))
    for where, found in sorted(damaged.items()):
        kinds = sorted({DAMAGE[p.kind] for p in found})
        click.echo(f"{where}: {', '.join(kinds)}")
        for problem in found:
            click.echo(f"  {problem.kind}: {problem.where}: {problem.detail}")
    if notes:
        for problem in described:
            click.echo(f"note: {problem.kind}: {problem.where}: {problem.detail}")
    click.echo(f"{len(damaged)} record file(s) with findings; {len(described)} note(s)"
               + ("" if notes else " (--notes lists them)"))
    if damaged:
        sys.exit(1)

@click.command(name="pack")
@click.argument("paths", nargs=-1)
@click.option("--results-dir", default="results", show_default=True, help="folder of run records (no PATHS)")
def pack_cmd(paths, results_dir) -> None:
    """Store finished record files gzip'd (<name>.jsonl.gz, byte for byte): every command reads
    them as before, and a run that resumes one unpacks it first. PATHS: record files or
    folders (default: every record file under --results-dir). A file a run is writing, or one
    ending in an unfinished line, is named and left as it is."""
    from pathlib import Path

    from bench.records import pack, record_files, record_name

    roots = [Path(p) for p in paths] or [Path(results_dir)]
    missing = [str(r) for r in roots if not r.exists()]
    if missing:
        raise BenchError(f"no such file or folder: {', '.join(missing)}")
    files = sorted({f for r in roots for f in ([record_name(r)] if r.is_file() else record_files(r, "**/*"))})
    if not files:
        raise BenchError(f"no record files (*.jsonl, *.jsonl.gz) under {', '.join(map(str, roots))}: nothing to pack")
    packed, saved, left = 0, 0, []
    for path in files:
        try:
            result = pack(path)
        except BenchError as exc:
            left.append(str(exc))
            continue
        if result is not None:
            packed, saved = packed + 1, saved + result
    for why in left:
        click.echo(f"left as it is: {why}", err=True)
    click.echo(f"packed {packed} record files ({saved / 1e6:.1f} MB saved); {len(files) - packed - len(left)} were "
               f"packed already; {len(left)} left as they are")

@click.command(name="import")
@click.argument("source")
@click.option("--format", "fmt", required=True, help="the file's format: specbench (a model_answer .jsonl)")
@click.option("--target", required=True, help="records' target folder name (results/<target>/)")
@click.option("--task", required=True, help="records' task folder name (e.g. specbench, mtbench)")
@click.option("--method", required=True, help="method name for the records (import a baseline as ar)")
@click.option("--tag", default=None, help="record series (a new file; existing records are never overwritten)")
@click.option("--results-dir", default="results", show_default=True)
def import_cmd(source, fmt, target, task, method, tag, results_dir) -> None:
    """Read another harness's answer file into run records that `bench report` shows; what
    the file does not say (token ids, TTFT, draft and verify times) is recorded as null."""
    from pathlib import Path

    from bench.registry import get_method
    from bench.specbench import check_format, import_answers

    check_format(fmt)
    get_method(method)  # records of a method the harness does not know would be read as nothing
    result = import_answers(Path(source), Path(results_dir), target, task, method, tag)
    notes = []
    if result.unsplit:
        notes.append(f"{result.unsplit} questions' accept lengths not split into turns (left out of τ)")
    if result.extra_choices:
        notes.append(f"{result.extra_choices} questions have several choices: choice 0 taken, as speed.py does")
    click.echo(f"imported {result.questions} questions ({result.turns} turns) into {result.path}"
               + (f"; {'; '.join(notes)}" if notes else ""))

@click.command()
@click.option("--method", default=None, help="a method with a trained drafter (see `bench list`); for --format "
              "specbench, the run's method (or give --run)")
@click.option("--format", "fmt", required=True,
              help="published layout: speculators | dflash | eagle | medusa; specbench: a run's answers; "
                   "speculation-profile: its acceptance profile (specdec_bench's acceptance_rate.json)")
@click.option("--out", "out_dir", required=True,
              help="new folder to write (must not exist or be empty); for specbench, the answer file")
@click.option("--drafter", default=None, help="drafter folder (default: user-trained, then shipped)")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id "
              "(for specbench: the records' target folder name)")
@click.option("--run", "run_file", default=None, help="specbench: the run's record file (instead of --target, "
              "--task, --method, --tag)")
@click.option("--task", default=None, help="specbench: the run's task (folder name under results/<target>/)")
@click.option("--tag", default=None, help="specbench: the run's tag")
@click.option("--results-dir", default="results", show_default=True, help="specbench: folder of run records")
@click.option("--baseline-out", default=None,
              help="specbench: the AR baseline's answer file (default: <out stem>-baseline.jsonl beside --out)")
@click.option("--force", is_flag=True, help="specbench: replace answer files that exist")
def export(method, fmt, out_dir, drafter, target, run_file, task, tag, results_dir, baseline_out, force) -> None:
    """Write a drafter in a published layout that vLLM / SGLang / the reference code load, or
    (--format specbench) a run's answers and its AR baseline's as Spec-Bench answer files."""
    import importlib
    from pathlib import Path

    from bench.core.target import load_target
    from bench.registry import get_method

    if fmt == "speculation-profile":
        return _export_profile(run_file, target, task, method, tag, results_dir, out_dir, force)
    if fmt == "specbench" or run_file or task:
        return _export_answers(fmt, run_file, target, task, method, tag, results_dir, out_dir, baseline_out, force)
    if method is None:
        raise BenchError("--method is needed to export a drafter")
    module = importlib.import_module(get_method(method).module)
    formats = getattr(module, "EXPORT_FORMATS", ())
    if fmt not in formats:
        raise BenchError(f"{method} exports to {', '.join(formats) or 'no published format'}, not '{fmt}'")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BenchError(f"export folder {out} exists and is not empty")
    loaded = load_target(target, "cpu", "float32")
    written = module.export(loaded, drafter, fmt, out)
    click.echo(f"exported {method} ({fmt} layout): {written}")

def _export_profile(run_file, target, task, method, tag, results_dir, out, force) -> None:
    """A run's acceptance profile as specdec_bench writes it (bench/speculation_profile.py)."""
    from pathlib import Path

    from bench.core.files import write_json
    from bench.records import records_path
    from bench.speculation_profile import problems, profile

    if run_file is None:
        from bench.core.target import DEFAULT_TARGET

        if not (task and method):
            raise BenchError("give the run: --run FILE, or --task and --method (with --target, --tag)")
        run_file = records_path(Path(results_dir), target or DEFAULT_TARGET, task, method, tag)
    out = Path(out)
    if out.exists() and not force:
        raise BenchError(f"{out} exists: give --force to replace it")
    found = profile(Path(run_file))
    failed = problems(found)
    if failed:  # an identity that fails is a bug in the records or here, never written silently
        raise BenchError(f"{run_file}: the profile fails {', '.join(failed)}")
    try:
        write_json(out, [found])
    except OSError as exc:
        raise BenchError(f"cannot write {out}: {exc.strerror or exc}") from None
    click.echo(f"speculation profile of {found['Source']['method']} ({found['Source']['turns']} turns, "
               f"{len(found['Per_Category'])} categories, mean tokens per step "
               f"{found['Checks']['mean_tokens_per_step_is_the_sum_of_joints']['mean']:.3f}): {out}")

def _export_answers(fmt, run_file, target, task, method, tag, results_dir, out, baseline_out, force) -> None:
    from pathlib import Path

    from bench.records import records_path
    from bench.specbench import check_format, export_run

    check_format(fmt)
    if run_file is None:
        from bench.core.target import DEFAULT_TARGET

        if not (task and method):
            raise BenchError("give the run: --run FILE, or --task and --method (with --target, --tag)")
        run_file = records_path(Path(results_dir), target or DEFAULT_TARGET, task, method, tag)
    result = export_run(Path(run_file), Path(out), Path(baseline_out) if baseline_out else None, force)
    for problem in result.problems:
        click.echo(f"{problem.kind}: {problem.where}: {problem.detail}", err=True)
    click.echo(f"exported {result.questions} questions ({result.turns} turns; {result.left_out} turns without "
               f"their pair left out): {', '.join(map(str, result.files))}")
    if result.speed is not None:
        speed = result.speed
        click.echo(f"Spec-Bench's speed.py convention on these files: {speed.tokens_per_s:.2f} tok/s vs "
                   f"{speed.baseline_tokens_per_s:.2f} baseline, speedup {speed.speedup:.3f}x (ratio of mean "
                   f"per-question tok/s), mean accepted tokens {speed.mean_accepted:.2f}")
