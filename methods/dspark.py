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
Options: see `Options` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bench.core.decode import LoopDecoder
from bench.core.errors import BenchError
from bench.core.options import Dtype, option, parse_options
from methods.dflash import block_for, load_model
from methods.dflash.drafter import BlockDrafter, BlockSettings

METHOD = "dspark"


@dataclass(frozen=True)
class Options:
    """schedule: throughput | threshold | none (see above); threshold: the cut for
    schedule=threshold; block: drafts per round before the schedule cuts (default the
    trained block size); drafter, dtype: as dflash.

    --budget K: block = K with schedule none, so every round verifies K drafts as dflash
    does; an explicit schedule wins, and K is then the most it may verify."""

    drafter: str | None = None
    block: int | None = option(None, min=1)
    schedule: Literal["throughput", "threshold", "none"] = "throughput"
    threshold: float = option(0.5, min=0.0, max=1.0)
    dtype: Dtype = "bfloat16"

    BUDGET_SOFT = ("schedule",)

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"block": budget, "schedule": "none"}

    def draft_budget(self) -> int | None:
        return self.block if self.schedule == "none" else None


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    from bench.core.costs import quick_chain_costs

    opts = parse_options(Options, options, METHOD)
    model, manifest = load_model(target, METHOD, opts)
    if not model.config.confidence:
        raise BenchError("the dspark drafter has no confidence head: train it with `bench train --method dspark`")
    settings = BlockSettings(mode="scheduled", block=block_for(model, opts.block, METHOD), schedule=opts.schedule,
                             threshold=opts.threshold)
    costs = quick_chain_costs(target.engine, settings.block + 1) if opts.schedule == "throughput" else None
    drafter = BlockDrafter(target, model, settings, name=METHOD, verify_seconds=costs)
    return LoopDecoder(target, drafter, manifest["info"])


def train(target, settings) -> dict:
    from methods.dflash.training import DSPARK_DEFAULTS, train_block

    return train_block(target, settings, METHOD, DSPARK_DEFAULTS)
