"""Training runs side by side (an ablation): each run's exported held-out numbers, its settings
and command, and its training log's accuracies over the same step windows, as one record.

Runs that share the data, seed and batch size see the same batches in the same order, so the
logs' windows compare the arms on the same examples.

    python -m scripts.compare_runs --run fc_norm=~/.cache/spec-bench/drafters-scale/eagle3-fcnorm \\
        --run paper=~/.cache/spec-bench/drafters-scale/eagle3-control --name eagle3-fc-norm --what "..."
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from bench.core.errors import BenchError
from bench.rounds import write_record


def log_windows(rows: list[dict], keys: list[str], every: int) -> dict[int, dict[str, float]]:
    """Mean of each key over steps (s - every, s] for s = every, 2 * every, ... while logged."""
    out: dict[int, dict[str, float]] = {}
    last = max((r["step"] for r in rows), default=0)
    for end in range(every, last + 1, every):
        window = [r for r in rows if end - every < r["step"] <= end]
        means = {k: round(sum(r[k] for r in window) / len(window), 4) for k in keys if window and k in window[0]}
        if means:
            out[end] = means
    return out


@click.command()
@click.option("--run", "runs", multiple=True, required=True, help="NAME=training folder (repeatable)")
@click.option("--name", required=True, help="the record's name (results/<target>/ablation/<name>.json)")
@click.option("--what", required=True, help="what the runs compare, one sentence")
@click.option("--every", default=200, show_default=True, help="training steps per log window")
@click.option("--keys", default="acc0,acc1,acc,loss", show_default=True, help="log fields averaged per window")
@click.option("--out", default="results/smollm2-135m/ablation", show_default=True)
def main(runs, name, what, every, keys, out) -> None:
    from bench.core.drafters import read_manifest
    from bench.training.loop import read_log

    try:
        found = {}
        for spec in runs:
            label, sep, folder = spec.partition("=")
            if not sep or not label:
                raise BenchError(f"--run takes NAME=FOLDER, got '{spec}'")
            folder = Path(folder).expanduser()
            manifest = read_manifest(folder)  # the last export: held-out numbers at its step
            rows = read_log(folder)
            if not rows:
                raise BenchError(f"{folder}: no training log")
            training = manifest.get("training", {})
            found[label] = {"folder": str(folder), "exported_step": training.get("steps"),
                            "logged_steps": rows[-1]["step"], "settings": training.get("settings"),
                            "runs": training.get("runs"), "architecture": manifest.get("architecture"),
                            "heldout": manifest.get("heldout"),
                            "log_windows": log_windows(rows, keys.split(","), every)}
            heldout = manifest.get("heldout", {})
            click.echo(f"{label}: step {training.get('steps')}, held-out top-1 by position "
                       f"{' / '.join(f'{a:.3f}' for a in heldout.get('top1_by_position', []))}, "
                       f"replayed τ {heldout.get('rounds_tau', float('nan')):.3f}")
    except BenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(f"-> {write_record(out, name, {'what': what, 'runs': found})}")


if __name__ == "__main__":
    main()
