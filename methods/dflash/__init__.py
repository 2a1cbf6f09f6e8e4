"""DFlash (Chen et al. 2602.06036): a block-diffusion drafter. One non-causal pass over
[root, MASK x (b-1)], conditioned on fused target features injected as keys/values into
every draft layer, drafts b tokens at once; the argmax chain is verified losslessly.

    bench train --method dflash [--option block_size=16 --option self_distill=true]
    bench run --method dflash --task humaneval [--option block=8]

The model, its decode-time drafting and its training live in methods/dflash/{model,
drafter,training}.py; DDTree (methods/ddtree.py) and DSpark (methods/dspark.py) share them.

Options: see `Options` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bench.core.decode import LoopDecoder
from bench.core.drafters import WEIGHTS, drafter_info, find_drafter, load_weights_into, open_drafter, read_weights
from bench.core.errors import BenchError
from bench.core.options import Dtype, option, parse_options
from methods.dflash.drafter import BlockDrafter, BlockSettings
from methods.dflash.model import BlockConfig, BlockDraftModel

METHOD = "dflash"


@dataclass(frozen=True)
class Options:
    """drafter: folder; block: drafts verified per round (<= the trained block size;
    default the whole block); dtype: drafting precision, bfloat16 by default (the drafter
    only proposes, so its precision changes acceptance, never the output).

    --budget K: block = K. The block's slots all draft, the anchor's (root) included: a
    pass over [root, MASK x (b-1)] gives b drafts, so block b verifies b tokens."""

    drafter: str | None = None
    block: int | None = option(None, min=1)
    dtype: Dtype = "bfloat16"

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"block": budget}

    def draft_budget(self) -> int | None:
        return self.block


def load_model(target, method: str, options) -> tuple[BlockDraftModel, dict]:
    """The block drafter for `target` from options.drafter, the user's cache or the shipped
    folder (`options`: any method's Options with drafter and dtype)."""
    folder = Path(find_drafter(target.name, method, options.drafter))
    manifest = open_drafter(target, folder, (METHOD, "dspark"))  # dspark's backbone is a dflash drafter
    try:
        config = BlockConfig(**manifest["architecture"])
    except (KeyError, TypeError) as exc:
        raise BenchError(f"drafter {folder} is not a block drafter ({exc})") from None
    model = BlockDraftModel(config)
    load_weights_into(model, read_weights(folder / manifest.get("weights", WEIGHTS)), folder)
    model = model.to(device=target.engine.device, dtype=getattr(torch, options.dtype)).eval()
    return model, dict(manifest, info=drafter_info(folder, manifest))


def block_for(model: BlockDraftModel, block: int | None, method: str) -> int:
    """The drafts per round: `block`, or the trained block size; never more than it."""
    size = model.config.block_size
    if block is not None and block > size:
        raise BenchError(f"{method} block {block} exceeds the drafter's trained block size {size} "
                         "(--option block / --budget)")
    return size if block is None else block


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    model, manifest = load_model(target, METHOD, opts)
    settings = BlockSettings(mode="chain", block=block_for(model, opts.block, METHOD))
    return LoopDecoder(target, BlockDrafter(target, model, settings, name=METHOD), manifest["info"])


def train(target, settings) -> dict:
    from methods.dflash.training import train_block

    return train_block(target, settings, METHOD)
