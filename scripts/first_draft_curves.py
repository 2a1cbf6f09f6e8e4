"""How fast each shipped drafter learned its first draft position per example seen, from the
training logs shipped with it (methods/checkpoints/<target>/<method>/log.jsonl.gz).

A block drafter (DFlash, DSpark) trains `anchors` blocks per conversation per step, so it
scores that many first-draft examples per conversation, while EAGLE-1/3 score every reply
position. Measured per step the block drafters look slow to learn; measured per example of
the first draft position they may not be. Examples per step: EAGLE-1/3 the step's reply
positions (the log's `tokens`); DFlash/DSpark min(tokens, anchors x batch), an upper bound
that is exact when every conversation has at least `anchors` reply positions (the pool's
conversations hold ~340 on average against 64 anchors).

    python -m scripts.first_draft_curves --readme results/README.md
"""

from __future__ import annotations

import ast
import gzip
import json
from pathlib import Path

import click

CHECKPOINTS = Path("methods/checkpoints")
FIRST_DRAFT_KEY = {"eagle": "acc", "eagle3": "acc0", "dflash": "acc0", "dspark": "acc0"}
NAMES = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}
BLOCK_METHODS = ("dflash", "dspark")


def _settings(manifest: dict) -> dict:
    settings = manifest["training"].get("settings", {})
    return ast.literal_eval(settings) if isinstance(settings, str) else settings


def curve(folder: Path, method: str) -> list[tuple[float, float, float]]:
    """(examples of the first draft position seen so far, this step's examples, its training
    accuracy there) per logged step; a shipped log keeping every k-th line counts k steps each."""
    manifest = json.loads((folder / "drafter.json").read_text())
    every = ((manifest.get("shipped_logs") or {}).get("log.jsonl") or {}).get("every_kth_line", 1)
    batch = manifest["training"]["batch_size"]
    anchors = _settings(manifest).get("anchors") if method in BLOCK_METHODS else None
    points, seen, last_step = [], 0.0, 0
    with gzip.open(folder / "log.jsonl.gz", "rt") as handle:
        for line in handle:
            row = json.loads(line)
            accuracy = row.get(FIRST_DRAFT_KEY[method])
            if accuracy is None:
                continue
            examples = float(row["tokens"]) if anchors is None else min(float(row["tokens"]), anchors * batch)
            steps = max(1, min(every, row["step"] - last_step))  # the lines left out between kept ones
            last_step = row["step"]
            seen += steps * examples
            points.append((seen, examples, float(accuracy)))
    return points


def accuracy_at(points: list[tuple[float, float, float]], examples: float, spread: float = 0.1) -> float | None:
    """The example-weighted mean training accuracy of the steps within ±spread of `examples` seen."""
    near = [(n, a) for seen, n, a in points if (1 - spread) * examples <= seen <= (1 + spread) * examples]
    return round(sum(n * a for n, a in near) / sum(n for n, _ in near), 4) if near else None


def markdown(result: dict) -> str:
    """The record as the README's table: accuracy by examples seen, and examples per step."""
    methods = list(result["methods"])
    marks = list(result["methods"][methods[0]]["accuracy_at"])
    lines = ["| examples seen | " + " | ".join(NAMES.get(m, m) for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for mark in marks:
        cells = [result["methods"][m]["accuracy_at"][mark] for m in methods]
        if all(c is None for c in cells):
            continue
        shown = ["-" if c is None else f"{c:.3f}" for c in cells]
        lines.append(f"| {float(mark) / 1e6:g}M | " + " | ".join(shown) + " |")
    lines.append("| examples a step | " + " | ".join(f"{result['methods'][m]['examples_per_step']:,.0f}"
                                                   for m in methods) + " |")
    return "\n".join(lines)


@click.command()
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--out", default="results/smollm2-135m/ablation/first-draft-curves.json", show_default=True)
@click.option("--readme", default=None, help="also write the table into this Markdown file's first-draft block")
def main(target: str, out: str, readme: str | None) -> None:
    from bench.core.provenance import git_sha, timestamp

    marks = [1e5, 2.5e5, 5e5, 1e6, 2e6, 4e6, 6e6]
    result = {"what": "training accuracy of the first draft position against the examples of it seen (shipped logs)",
              "examples_per_step": "eagle/eagle3: reply positions; "
                                   "dflash/dspark: min(reply positions, anchors x batch)",
              "git_sha": git_sha(), "created_at": timestamp(), "methods": {}}
    click.echo("examples seen  " + "  ".join(f"{m:>8}" for m in FIRST_DRAFT_KEY))
    curves = {m: curve(CHECKPOINTS / target / m, m) for m in FIRST_DRAFT_KEY}
    for method, points in curves.items():
        folder = CHECKPOINTS / target / method
        manifest = json.loads((folder / "drafter.json").read_text())
        result["methods"][method] = {
            "drafter_weights": manifest.get("weights_sha1"), "steps": manifest["training"]["steps"],
            "batch_size": manifest["training"]["batch_size"], "anchors": _settings(manifest).get("anchors"),
            "examples_total": round(points[-1][0]) if points else 0,
            "examples_per_step": round(points[-1][0] / max(1, manifest["training"]["steps"]), 1) if points else 0,
            "accuracy_at": {f"{mark:g}": accuracy_at(points, mark) for mark in marks}}
    for mark in marks:
        cells = [result["methods"][m]["accuracy_at"][f"{mark:g}"] for m in FIRST_DRAFT_KEY]
        click.echo(f"{mark:>13,.0f}  " + "  ".join(f"{c:8.3f}" if c is not None else f"{'-':>8}" for c in cells))
    per_step = [result["methods"][m]["examples_per_step"] for m in FIRST_DRAFT_KEY]
    click.echo("examples/step  " + "  ".join(f"{n:8.0f}" for n in per_step))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    click.echo(f"-> {path}")
    if readme:
        from bench.report.tables import update_readme

        update_readme(Path(readme), {"first-draft": markdown(result)})
        click.echo(f"-> {readme}")


if __name__ == "__main__":
    main()
