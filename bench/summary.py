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
            rows.append({"task": task_dir.name, "method": method, **row})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| task | method | turns | τ | a_1 | a_2 | a_3 | a_4 | draft ms/round | tok/s | exact match | near ties "
             "| mismatches | speedup [95% CI] | model τ·t0/(t_d+t_v) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        accept = (row["accept_cond"] + [float("nan")] * 4)[:4]
        low, high = row.get("speedup_ci") or (float("nan"), float("nan"))
        lines.append(f"| {row['task']} | {row['method']} | {row['turns']} | {row['tau']:.2f} | "
                     + " | ".join(f"{a:.2f}" for a in accept)
                     + f" | {1e3 * row['draft_s_per_round']:.1f} | {row['tokens_per_s']:.1f}"
                     + f" | {100 * row['match_rate']:.0f}% | {row['near_ties']} | {row['mismatches']} | "
                     f"{row['speedup']:.2f}x [{low:.2f}, {high:.2f}] | {row.get('speedup_model', float('nan')):.2f}x |")
    return "\n".join(lines)


@click.command()
@click.option("--results-dir", default="results", show_default=True)
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--tag", default=None)
def main(results_dir: str, target: str, tag: str | None) -> None:
    click.echo(format_table(summary_rows(Path(results_dir), target, tag)))


if __name__ == "__main__":
    main()
