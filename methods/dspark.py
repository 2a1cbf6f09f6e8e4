"""DSpark (Cheng et al. 2607.05147): the DFlash backbone plus a Markov head and a
confidence head, with confidence-scheduled verification.

- Markov head: each slot's logits get a rank-r bigram correction from the previous draft
  token, applied left to right, so drafts are semi-autoregressive at almost no cost and
  a sampled draft's q is exactly the distribution it was drawn from.
- Confidence head: predicts each slot's survival given its prefix survived; the round
  verifies only as many drafts as maximise expected tokens per second under this
  device's verification cost curve t_v(k) (schedule=throughput), or cuts at the first
  confidence below a threshold (schedule=threshold), or verifies the whole block (none).

    bench train --method dspark [--option block_size=16 --option markov_rank=64]
    bench run --method dspark --task humaneval [--option schedule=threshold --option threshold=0.5]

t_v(k) comes from a few seconds of measurement on the target when the decoder is built.
Options: drafter, dtype, block (as dflash), schedule, threshold.
"""

from __future__ import annotations

from bench.core.decode import LoopDecoder
from bench.core.errors import BenchError
from methods.dflash import int_option, load_model
from methods.dflash.drafter import BlockDrafter, BlockSettings

METHOD = "dspark"
SCHEDULES = ("throughput", "threshold", "none")


def build(target, options: dict) -> LoopDecoder:
    from bench.core.costs import quick_chain_costs

    model, manifest = load_model(target, METHOD, options)
    if not model.config.confidence:
        raise BenchError("the dspark drafter has no confidence head: train it with `bench train --method dspark`")
    size = model.config.block_size
    schedule = str(options.get("schedule", "throughput"))
    if schedule not in SCHEDULES:
        raise BenchError(f"unknown schedule '{schedule}' (choose from {', '.join(SCHEDULES)})")
    try:
        threshold = float(options.get("threshold", 0.5))
    except (TypeError, ValueError):
        raise BenchError(f"option threshold must be a number, got '{options.get('threshold')}'") from None
    settings = BlockSettings(mode="scheduled", block=int_option(options, "block", size, 1, size),
                             schedule=schedule, threshold=threshold)
    costs = quick_chain_costs(target.engine, settings.block + 1) if schedule == "throughput" else None
    drafter = BlockDrafter(target, model, settings, name=METHOD, verify_seconds=costs)
    return LoopDecoder(target, drafter, manifest["info"])


def train(target, settings) -> dict:
    from methods.dflash.training import DSPARK_DEFAULTS, train_block

    return train_block(target, settings, METHOD, DSPARK_DEFAULTS)
