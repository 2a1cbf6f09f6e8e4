"""A Markdown table of recorded runs (τ, acceptance, lossless audit, speedup), the report's
own selection and numbers (bench.report.tables), so figures quoted anywhere come from kept records.

    python -m bench.report.summary --target smollm2-135m --tag audit
    python -m bench.report.summary --tag grid --readme grid   # also rewrite results/README.md's `grid` block
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from bench import metrics
from bench.cli_errors import OneLineCommand
from bench.core.errors import BenchError
from bench.records import BASELINE
from bench.report.tables import RESULTS_README, contended_turns, load_records, summarize, update_readme


def summary_rows(results_dir: Path, target: str, tag: str | None) -> list[dict]:
    """A row per (task, method) of one series: the report's own selection (`Shelf.select`, the
    newest revision, repeats pooled) and its own numbers (`summarize`), plus what this table
    adds (verified per accepted, thread counts, contended turns). What the selection leaves
    out is printed as a warning, as `bench report` lists it."""
    try:
        records = load_records(results_dir, targets=(target,), tags=(tag or "",))
    except BenchError:
        return []
    for problem in records.problems:
        if problem.kind not in ("superseded", "missing"):
            click.echo(f"warning: {problem.kind}: {problem.where}: {problem.detail}", err=True)
    frame = summarize(records, "task")
    rows = []
    for row in frame.to_dict("records") if not frame.empty else []:
        if row["method"] == BASELINE:
            continue
        # a frame cell is NaN where a row has no such value (no baseline: no interval, no passes)
        row = {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))
               or k not in ("speedup_ci", "speedup_repeats")}
        runs = [r for r in records.runs if (r.task, r.method) == (row["task"], row["method"])]
        turns = [t for run in runs for t in run.pooled]
        base = [t for run in records.runs if (run.task, run.method) == (row["task"], BASELINE) for t in run.pooled]
        if math.isnan(row.get("base_tokens_per_s", math.nan)):  # not paired: its contended turns say nothing
            base = []
        rows.append({**row, "nodes_per_round": 0.0 if math.isnan(row["tree_size"]) else row["tree_size"],
                     "verified_per_accepted": nodes_per_accepted(turns),
                     "threads": "/".join(map(str, sorted({t["_threads"] for t in turns if t.get("_threads")}))),
                     "contended": _contended(turns) + _contended(base)})
    return rows


def _contended(turns: list[dict]) -> int:
    """Turns that shared the CPU, each pass judged on its own (bench.report.tables.contended_turns)."""
    return sum(len(contended_turns([t for t in turns if t["repeat"] == repeat]))
               for repeat in {t["repeat"] for t in turns})


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
