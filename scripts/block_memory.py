"""Peak memory of one DSpark training step at many anchors, with and without the loss in chunks
(`loss_chunk_rows`) and the draft layers recomputed in the backward pass (`checkpoint_layers`).

Each configuration runs in a fresh process: the default target, a 3-layer DSpark drafter with
blocks of 16, and random features for `--batch` conversations of `--width` tokens, every position
a reply position; the peak resident memory above what loading took, and the step's seconds.

    python -m scripts.block_memory --out results/smollm2-135m/profile/block-memory.json
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import click

CONFIGS = [(8192, False), (8192, True), (2048, False), (2048, True)]  # (loss_chunk_rows, checkpoint_layers)


def one_step(chunk: int, recompute: bool, anchors: int, batch: int, width: int) -> dict:
    import torch

    from bench.core.target import load_target
    from methods.dflash.model import BlockConfig, BlockDraftModel, zlab_taps
    from methods.dflash.training import DSPARK_DEFAULTS, BlockObjective, BlockTrainSettings

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = load_target(None, "cpu", "float32")
    layers = target.config.num_hidden_layers
    config = BlockConfig.for_target(target.config, zlab_taps(layers, 3), num_layers=3, block_size=16,
                                    markov_rank=32, enable_confidence_head=True, sample_from_anchor=True)
    weights = {k: v for k, v in DSPARK_DEFAULTS.items() if k in ("ce_weight", "l1_weight", "bce_weight")}
    settings = BlockTrainSettings(block_size=16, anchors=anchors, loss_chunk_rows=chunk, checkpoint_layers=recompute,
                                  markov_rank=32, enable_confidence_head=True, sample_from_anchor=True, **weights)
    objective = BlockObjective(BlockDraftModel(config), target.engine.embed.float(), target.engine.lm_head.float(),
                               layers, settings, autocast=True)
    data = {"tokens": torch.randint(0, 40000, (batch, width)), "mask": torch.ones(batch, width, dtype=torch.bool),
            "lengths": torch.full((batch,), width),
            **{f"h{t}": torch.randn(batch, width, target.config.hidden_size) for t in set(config.taps) | {layers}}}
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    loss, _ = objective.loss(data)
    loss.backward()
    return {"loss_chunk_rows": chunk, "checkpoint_layers": recompute, "anchors": anchors, "batch": batch,
            "width": width, "seconds": round(time.perf_counter() - began, 1),
            "peak_mb_over_loaded": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - loaded) // 1024}


@click.command()
@click.option("--anchors", default=512, show_default=True)
@click.option("--batch", default=2, show_default=True)
@click.option("--width", default=500, show_default=True)
@click.option("--out", default="results/smollm2-135m/profile/block-memory.json", show_default=True)
@click.option("--one", default=None, hidden=True, help="chunk,recompute: run that configuration here")
def main(anchors: int, batch: int, width: int, out: str, one: str | None) -> None:
    if one is not None:
        chunk, recompute = one.split(",")
        print(json.dumps(one_step(int(chunk), recompute == "1", anchors, batch, width)))
        return
    from bench.core.provenance import provenance, timestamp

    rows = []
    for chunk, recompute in CONFIGS:
        done = subprocess.run([sys.executable, "-m", "scripts.block_memory", "--anchors", str(anchors), "--batch",
                               str(batch), "--width", str(width), "--one", f"{chunk},{int(recompute)}"],
                              capture_output=True, text=True)
        if done.returncode:
            raise click.ClickException(f"loss_chunk_rows={chunk} checkpoint_layers={recompute}: "
                                       f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        click.echo(rows[-1])
    record = {"what": "peak memory of one DSpark training step (3 layers, blocks of 16, random features)",
              "rows": rows, "provenance": provenance("cpu"), "created_at": timestamp()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1))
    click.echo(f"-> {out}")


if __name__ == "__main__":
    main()
