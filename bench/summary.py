"""A Markdown table of recorded runs (τ, acceptance, lossless audit, speedup) read from the
record files, so figures quoted anywhere come from kept records.

    python -m bench.summary --target smollm2-135m --tag audit
    python -m bench.summary --tag grid --readme grid   # also rewrite results/README.md's `grid` block
"""

from __future__ import annotations

from pathlib import Path

import click

from bench import metrics
from bench.cli_errors import OneLineCommand
from bench.core.errors import BenchError
from bench.records import BASELINE, Problem, pairing_difference, parse_tag, pool_repeats, read_run, record_files
from bench.tables import RESULTS_README, contended_turns, update_readme


def summary_rows(results_dir: Path, target: str, tag: str | None) -> list[dict]:
    rows = []
    if not (results_dir / target).is_dir():
        return rows
    for task_dir in sorted((results_dir / target).iterdir()):
        if not task_dir.is_dir() or task_dir.name == "peers":
            continue
        files = series_files(task_dir, tag)
        for method, revisions in sorted(files.items()):
            if method == BASELINE:
                continue
            newest = max(revisions)  # a method's newest revision, against the baseline of that revision
            runs, base_runs = _runs(revisions[newest]), _runs(files.get(BASELINE, {}).get(newest, []))
            turns, base = _pooled(runs), _pooled(base_runs)
            if not turns:  # every file left out: the warnings say why
                continue
            why = pairing_difference(runs[0].settings, base_runs[0].settings) if base_runs else None
            if why:  # never a speedup or an exact match against a baseline of other settings
                click.echo(f"warning: unpaired: {runs[0].path}: recorded with {why}; no speedup", err=True)
                base = []
            row = metrics.summarize(turns, base)
            sized = metrics.known(turns, "accept_lengths", "tree_sizes")  # imported turns may lack them
            rounds = sum(len(t["accept_lengths"]) for t in sized)
            rows.append({"task": task_dir.name, "method": method, **row,
                         "nodes_per_round": sum(sum(t["tree_sizes"]) for t in sized) / rounds if rounds else 0.0,
                         "verified_per_accepted": nodes_per_accepted(turns),
                         "threads": "/".join(map(str, sorted({t["_threads"] for t in turns if t.get("_threads")}))),
                         "contended": _contended(turns) + _contended(base)})
    return rows


def series_files(task_dir: Path, tag: str | None) -> dict[str, dict[int, list[tuple[int, Path]]]]:
    """{method: {revision: [(repeat, record file)]}} of one series in a task folder: its
    revisions (`grid.r2`, bench.grid) and their repeats."""
    found: dict[str, dict[int, list[tuple[int, Path]]]] = {}
    for path in record_files(task_dir):
        method, _, file_tag = path.stem.partition("-")
        series, revision, repeat = parse_tag(file_tag)
        if series == (tag or ""):
            found.setdefault(method, {}).setdefault(revision, []).append((repeat, path))
    return found


def _contended(turns: list[dict]) -> int:
    """Turns that shared the CPU, each pass judged on its own (bench.tables.contended_turns)."""
    return sum(len(contended_turns([t for t in turns if t["repeat"] == repeat]))
               for repeat in {t["repeat"] for t in turns})


def _runs(files: list[tuple[int, Path]]) -> list:
    """The runs of a series' files (bench.records' rule), its repeats kept when recorded with
    the same settings; what is left out is shown, not fatal: `bench report` lists it too."""
    problems: list[Problem] = []
    runs = [run for _, path in files if (run := read_run(path, problems)) is not None]
    runs, mixed = pool_repeats(runs)
    for problem in problems + mixed:
        click.echo(f"warning: {problem.kind}: {problem.where}: {problem.detail}", err=True)
    return runs


def _pooled(runs: list) -> list[dict]:
    return [turn for run in runs for turn in run.pooled]


def nodes_per_accepted(turns: list[dict]) -> float:
    """Draft tokens verified per accepted draft token (the inverse of draft efficiency)."""
    turns = metrics.known(turns, "accept_lengths", "tree_sizes")
    accepted = sum(sum(t["accept_lengths"]) for t in turns)
    return sum(sum(t["tree_sizes"]) for t in turns) / accepted if accepted else float("nan")


def format_table(rows: list[dict], tags: bool = False) -> str:
    """Markdown table; with `tags`, a first column says which series each row is from. Where
    some row pools several passes (`bench run --repeats`), a last column gives the speedup of
    each pass: median [min, max]."""
    repeats = any(len(row.get("speedup_repeats", [])) > 1 for row in rows)
    lines = [("| tag " if tags else "") + "| task | method | turns | τ | a_1 | a_2 | a_3 | a_4 | draft ms/round "
             "| nodes/round | verified per accepted | tok/s | AR tok/s beside it | exact match | near ties "
             "| mismatches | speedup [95% CI] "
             "| model τ·t0/(t_d+t_v) |" + (" speedup per pass |" if repeats else ""),
             "|---" * (18 + tags + repeats) + "|"]
    for row in rows:
        accept = (row["accept_cond"] + [float("nan")] * 4)[:4]
        low, high = row.get("speedup_ci") or (float("nan"), float("nan"))
        line = ((f"| {row['tag']} " if tags else "") + f"| {row['task']} | {row['method']} | {row['turns']} | "
                f"{row['tau']:.2f} | "
                + " | ".join(f"{a:.2f}" for a in accept)
                + f" | {1e3 * row['draft_s_per_round']:.1f} | {row['nodes_per_round']:.1f} "
                f"| {row['verified_per_accepted']:.1f} | {row['tokens_per_s']:.1f} "
                f"| {row.get('base_tokens_per_s', float('nan')):.1f}"
                + f" | {100 * row['match_rate']:.0f}% | {row['near_ties']} | {row['mismatches']} | "
                f"{row['speedup']:.2f}x [{low:.2f}, {high:.2f}] | {row.get('speedup_model', float('nan')):.2f}x |")
        if repeats:
            passes = row.get("speedup_repeats", [])
            median, least, most = metrics.spread(passes)
            line += (f" {median:.2f}x [{least:.2f}, {most:.2f}] ({len(passes)} passes) |" if len(passes) > 1
                     else f" {median:.2f}x (1 pass) |")
        lines.append(line)
    contended = [f"{row['task']} {row['method']}" + (f" [{row['tag']}]" if tags else "") + f" {row['contended']}"
                 for row in rows if row.get("contended")]
    by_threads: dict[str, list[str]] = {}
    for row in rows:
        if row.get("threads"):
            series = f"{row['method']}" + (f" [{row['tag']}]" if tags else "")
            alike = {other.get("threads") for other in rows
                     if other["method"] == row["method"] and other.get("tag") == row.get("tag")} == {row["threads"]}
            label = series if alike else f"{row['task']} {series}"  # a method named once where all its cells agree
            if label not in by_threads.setdefault(row["threads"], []):
                by_threads[row["threads"]].append(label)
    if len(by_threads) > 1:  # a pooled row then compares methods timed at different thread counts
        lines += ["", "Cells ran at different torch thread counts (each speedup is against the AR timed beside it): "
                  + "; ".join(f"{threads} thread(s): {', '.join(labels)}"
                              for threads, labels in sorted(by_threads.items())) + "."]
    if contended:
        lines += ["", "Turns that shared the CPU with another job (method and baseline files; their times read "
                  "slow, see `bench report`): " + ", ".join(contended) + "."]
    return "\n".join(lines)


@click.command(cls=OneLineCommand)
@click.option("--results-dir", default="results", show_default=True)
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--tag", "tags", multiple=True, help="record series (repeatable: one table, a row per tag)")
@click.option("--task", "tasks", multiple=True, help="only these tasks (repeatable)")
@click.option("--method", "methods", multiple=True, help="only these methods (repeatable)")
@click.option("--readme", "block", default=None, metavar="NAME",
              help="also write the table between the '<!-- NAME:start -->' and ':end' markers of --readme-path")
@click.option("--readme-path", default=str(RESULTS_README), show_default=True)
def main(results_dir: str, target: str, tags: tuple[str, ...], tasks: tuple[str, ...], methods: tuple[str, ...],
         block: str | None, readme_path: str) -> None:
    rows = []
    for tag in tags or (None,):
        rows += [dict(row, tag=tag) for row in summary_rows(Path(results_dir), target, tag)
                 if (not tasks or row["task"] in tasks) and (not methods or row["method"] in methods)]
    if not rows:
        raise BenchError(f"no records for target '{target}' with tag(s) {', '.join(map(str, tags)) or '-'}"
                         f" under {results_dir}")
    table = format_table(rows, tags=len(tags) > 1)
    if block:  # first: a README that cannot be written leaves one error line and nothing else
        update_readme(Path(readme_path), {block: table})
    click.echo(table)


if __name__ == "__main__":
    main()
