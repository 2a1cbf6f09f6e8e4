"""DSpark (Cheng et al. 2607.05147): the DFlash backbone plus a Markov head and a
confidence head, with confidence-scheduled verification.

Conventions: the paper's and DeepSpec's, with speculators' names (models/dspark: config
`markov_rank`, `markov_head_type` vanilla, `enable_confidence_head`,
`confidence_head_with_markov`, `sample_from_anchor`; weights `markov_head.markov_w1`,
`markov_head.markov_w2`, `confidence_head.proj`). The backbone is z-lab's DFlash (q/k-norm,
the target's embedding of `mask_token_id` in the mask slots, z-lab taps); as in the paper
(§3.1: gamma inputs give gamma logits) and speculators' dspark default, the anchor slot drafts
too (`sample_from_anchor=True`: a block of B slots gives B drafts). A drafter trained with
`--option sample_from_anchor=false` drafts B-1, as DFlash.

- Markov head: each slot's logits get a rank-r bigram correction from the previous draft
  token, applied left to right, so drafts are semi-autoregressive at almost no cost and
  a sampled draft's q is exactly the distribution it was drawn from.
- Confidence head: predicts each slot's survival given its prefix survived; the round
  verifies only as many drafts as maximise expected tokens per second under this
  device's verification cost curve t_v(k) (schedule=throughput), or cuts at the first
  confidence below a threshold (schedule=threshold), or verifies the whole block (none).

    bench train --method dspark [--option block_size=16 --option markov_rank=64]
    bench run --method dspark --task humaneval [--option schedule=threshold --option threshold=0.5]
    bench export --method dspark --format speculators --out DIR

t_v(k) comes from a few seconds of measurement on the target when the decoder is built.
Options: see `Options` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench.core.decode import LoopDecoder
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, Dtype, option, parse_options
from methods.dflash import block_for, load_model
from methods.dflash.drafter import BlockDrafter, BlockSettings

METHOD = "dspark"
CONVENTION = ("DSpark paper + speculators models/dspark: z-lab backbone, sample_from_anchor (B drafts), "
              "markov_w1/markov_w2, confidence_head")
EXPORT_FORMATS = ("speculators",)


@dataclass(frozen=True)
class Options(DraftOptions):
    """schedule: throughput | threshold | none (see above); threshold: the cut for
    schedule=threshold; block: drafts per round before the schedule cuts (default all of a
    block's: B with sample_from_anchor, B-1 without); drafter, dtype: as dflash.

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
    if not model.config.enable_confidence_head:
        raise BenchError("the dspark drafter has no confidence head: train it with `bench train --method dspark`")
    settings = BlockSettings(mode="scheduled", block=block_for(model, opts.block, METHOD), schedule=opts.schedule,
                             threshold=opts.threshold)
    costs = quick_chain_costs(target.engine, settings.block + 1) if opts.schedule == "throughput" else None
    drafter = BlockDrafter(target, model, settings, name=METHOD, verify_seconds=costs)
    return LoopDecoder(target, drafter, manifest["info"])


def export(target, drafter: str | None, fmt: str, out: Path) -> Path:
    """Write the dspark drafter (found as `bench run` finds it) as a speculators dspark folder."""
    from bench.core.drafters import find_drafter
    from methods.dflash.formats import export_drafter

    if fmt not in EXPORT_FORMATS:
        raise BenchError(f"{METHOD} exports to {', '.join(EXPORT_FORMATS)}, not '{fmt}'")
    return export_drafter(target, Path(find_drafter(target.name, METHOD, drafter)), fmt, Path(out), (METHOD,))


def train(target, settings) -> dict:
    from methods.dflash.training import DSPARK_DEFAULTS, train_block

    return train_block(target, settings, METHOD, DSPARK_DEFAULTS)
