"""DFlash (Chen et al. 2602.06036): a block-diffusion drafter. One non-causal pass over
[root, MASK x (B-1)], conditioned on fused target features injected as keys/values into
every draft layer, drafts the B-1 mask slots' tokens at once; the argmax chain is verified
losslessly. Conventions are z-lab's (z-lab/dflash `dflash/model.py`, see CONVENTION and
methods/dflash/model.py); what a drafter follows is in its config and in every run record.

    bench train --method dflash [--option block_size=16 --option num_layers=3]
    bench run --method dflash --task humaneval [--option block=8]
    bench export --method dflash --format dflash --out DIR   (or --format speculators)

`--drafter` takes our drafter folders, z-lab DFlash folders and speculators dflash/dspark
folders (methods/dflash/formats.py). The model, its decode-time drafting and its training
live in methods/dflash/{model,drafter,training}.py; DDTree (methods/ddtree.py) and DSpark
(methods/dspark.py) share them.

Options: see `Options` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bench.core.decode import LoopDecoder
from bench.core.drafters import find_drafter, load_weights_into
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, Dtype, option, parse_options
from methods.dflash.drafter import BlockDrafter, BlockSettings
from methods.dflash.model import BlockDraftModel

METHOD = "dflash"
CONVENTION = ("z-lab DFlash (z-lab/dflash dflash/model.py): [anchor, MASK x (B-1)] gives B-1 drafts, "
              "the target's mask-token embedding, q/k-norm")
EXPORT_FORMATS = ("dflash", "speculators")


@dataclass(frozen=True)
class Options(DraftOptions):
    """drafter: folder (ours, z-lab DFlash or speculators dflash/dspark); block: drafts
    verified per round, at most the drafter's drafts per block (B-1 for a block of B slots
    under z-lab's convention, B with sample_from_anchor; default all of them); dtype:
    drafting precision, bfloat16 by default (the drafter only proposes, so its precision
    changes acceptance, never the output).

    --budget K: block = K, K drafts per round: one pass over [root, MASK x K] (z-lab's
    convention; [root, MASK x (K-1)] with sample_from_anchor)."""

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
    folder (`options`: any method's Options with drafter and dtype), in any layout that
    methods/dflash/formats.py reads. Returns the model and {"info": what run records keep}."""
    from methods.dflash.formats import read_drafter

    folder = Path(find_drafter(target.name, method, options.drafter))
    config, state, info = read_drafter(target, folder, (METHOD, "dspark"))  # dspark's backbone is a dflash drafter
    model = BlockDraftModel(config)
    load_weights_into(model, state, folder)
    model = model.to(device=target.engine.device, dtype=getattr(torch, options.dtype)).eval()
    return model, {"info": info}


def block_for(model: BlockDraftModel, block: int | None, method: str) -> int:
    """The drafts per round: `block`, or all of a block's; never more than a block drafts."""
    size = model.config.drafts_per_block
    if block is not None and block > size:
        raise BenchError(f"{method} block {block} exceeds the drafter's {size} drafts per block "
                         f"(block_size {model.config.block_size}, {model.config.convention} convention; "
                         "--option block / --budget)")
    return size if block is None else block


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    model, loaded = load_model(target, METHOD, opts)
    settings = BlockSettings(mode="chain", block=block_for(model, opts.block, METHOD))
    return LoopDecoder(target, BlockDrafter(target, model, settings, name=METHOD), loaded["info"])


def train(target, settings) -> dict:
    from methods.dflash.training import train_block

    return train_block(target, settings, METHOD)


def export(target, drafter: str | None, fmt: str, out: Path) -> Path:
    """Write the dflash drafter (found as `bench run` finds it) in a published layout:
    `dflash` (z-lab's, which the reference dflash_generate loads) or `speculators`."""
    from methods.dflash.formats import export_drafter

    if fmt not in EXPORT_FORMATS:
        raise BenchError(f"{METHOD} exports to {', '.join(EXPORT_FORMATS)}, not '{fmt}'")
    folder = Path(find_drafter(target.name, METHOD, drafter))
    return export_drafter(target, folder, fmt, Path(out), (METHOD, "dspark"))
