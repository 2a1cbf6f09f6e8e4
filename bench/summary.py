"""A Markdown table of recorded runs (τ, acceptance, lossless audit, speedup) read from the
record files, so figures quoted anywhere come from kept records.

    python -m bench.summary --target smollm2-135m --tag audit
"""

from __future__ import annotations

from pathlib import Path

import click

from bench import metrics
from bench.records import read_records


def summary_rows(results_dir: Path, target: str, tag: str | None) -> list[dict]:
    rows = []
    suffix = f"-{tag}.jsonl" if tag else ".jsonl"
    for task_dir in sorted((results_dir / target).iterdir()):
        if not task_dir.is_dir() or task_dir.name == "peers":
            continue
        base_path = task_dir / f"ar{suffix}"
        _, base = read_records(base_path) if base_path.exists() else ([], [])
        for path in sorted(task_dir.glob(f"*{suffix}")):
            method = path.name[: -len(suffix)]
            if method == "ar" or (not tag and "-" in method):
                continue
            _, turns = read_records(path)
            row = metrics.summarize(turns, base)
            rounds = sum(len(t["accept_lengths"]) for t in turns)
            rows.append({"task": task_dir.name, "method": method, **row,
                         "nodes_per_round": sum(sum(t["tree_sizes"]) for t in turns) / rounds if rounds else 0.0,
                         "verified_per_accepted": nodes_per_accepted(turns)})
    return rows


def nodes_per_accepted(turns: list[dict]) -> float:
    """Draft tokens verified per accepted draft token (the inverse of draft efficiency)."""
    accepted = sum(sum(t["accept_lengths"]) for t in turns)
    return sum(sum(t["tree_sizes"]) for t in turns) / accepted if accepted else float("nan")


def format_table(rows: list[dict], tags: bool = False) -> str:
    """Markdown table; with `tags`, a first column says which series each row is from."""
    lines = [("| tag " if tags else "") + "| task | method | turns | τ | a_1 | a_2 | a_3 | a_4 | draft ms/round "
             "| nodes/round | verified per accepted | tok/s | exact match | near ties | mismatches | speedup [95% CI] "
             "| model τ·t0/(t_d+t_v) |",
             "|---" * (17 + tags) + "|"]
    for row in rows:
        accept = (row["accept_cond"] + [float("nan")] * 4)[:4]
        low, high = row.get("speedup_ci") or (float("nan"), float("nan"))
        lines.append((f"| {row['tag']} " if tags else "") + f"| {row['task']} | {row['method']} | {row['turns']} | "
                     f"{row['tau']:.2f} | "
                     + " | ".join(f"{a:.2f}" for a in accept)
                     + f" | {1e3 * row['draft_s_per_round']:.1f} | {row['nodes_per_round']:.1f} "
                     f"| {row['verified_per_accepted']:.1f} | {row['tokens_per_s']:.1f}"
                     + f" | {100 * row['match_rate']:.0f}% | {row['near_ties']} | {row['mismatches']} | "
                     f"{row['speedup']:.2f}x [{low:.2f}, {high:.2f}] | {row.get('speedup_model', float('nan')):.2f}x |")
    return "\n".join(lines)


@click.command()
@click.option("--results-dir", default="results", show_default=True)
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--tag", "tags", multiple=True, help="record series (repeatable: one table, a row per tag)")
@click.option("--task", "tasks", multiple=True, help="only these tasks (repeatable)")
def main(results_dir: str, target: str, tags: tuple[str, ...], tasks: tuple[str, ...]) -> None:
    rows = []
    for tag in tags or (None,):
        rows += [dict(row, tag=tag) for row in summary_rows(Path(results_dir), target, tag)
                 if not tasks or row["task"] in tasks]
    click.echo(format_table(rows, tags=len(tags) > 1))


if __name__ == "__main__":
    main()
