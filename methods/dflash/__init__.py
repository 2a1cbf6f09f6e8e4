"""DFlash (Chen et al. 2602.06036): a block-diffusion drafter. One non-causal pass over
[root, MASK x (b-1)], conditioned on fused target features injected as keys/values into
every draft layer, drafts b tokens at once; the argmax chain is verified losslessly.

    bench train --method dflash [--option block_size=16 --option self_distill=true]
    bench run --method dflash --task humaneval [--option block=8]

The model, its decode-time drafting and its training live in methods/dflash/{model,
drafter,training}.py; DDTree (methods/ddtree.py) and DSpark (methods/dspark.py) share them.

Options: drafter (folder), block (drafts verified per round, <= the trained block size;
default the whole block), dtype (drafting precision, default bfloat16: the drafter only
proposes, so its precision changes acceptance, never the output).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.core.decode import LoopDecoder
from bench.core.drafters import WEIGHTS, drafter_info, find_drafter, load_weights_into, open_drafter, read_weights
from bench.core.errors import BenchError
from methods.dflash.drafter import BlockDrafter, BlockSettings
from methods.dflash.model import BlockConfig, BlockDraftModel

METHOD = "dflash"


def load_model(target, method: str, options: dict) -> tuple[BlockDraftModel, dict]:
    """The block drafter for `target` from options["drafter"], the user's cache or the shipped folder."""
    folder = Path(find_drafter(target.name, method, options.get("drafter")))
    manifest = open_drafter(target, folder, (METHOD, "dspark"))  # dspark's backbone is a dflash drafter
    try:
        config = BlockConfig(**manifest["architecture"])
    except (KeyError, TypeError) as exc:
        raise BenchError(f"drafter {folder} is not a block drafter ({exc})") from None
    model = BlockDraftModel(config)
    load_weights_into(model, read_weights(folder / manifest.get("weights", WEIGHTS)), folder)
    dtype = getattr(torch, str(options.get("dtype", "bfloat16")), None)
    if not isinstance(dtype, torch.dtype):
        raise BenchError(f"unknown dtype '{options.get('dtype')}'")
    model = model.to(device=target.engine.device, dtype=dtype).eval()
    return model, dict(manifest, info=drafter_info(folder, manifest))


def int_option(options: dict, name: str, default: int, low: int = 1, high: int | None = None) -> int:
    try:
        value = int(options.get(name, default))
    except (TypeError, ValueError):
        raise BenchError(f"option {name} must be an integer, got '{options.get(name)}'") from None
    if value < low or (high is not None and value > high):
        raise BenchError(f"option {name}={value} is out of range [{low}, {high if high is not None else '...'}]")
    return value


def build(target, options: dict) -> LoopDecoder:
    model, manifest = load_model(target, METHOD, options)
    size = model.config.block_size
    settings = BlockSettings(mode="chain", block=int_option(options, "block", size, 1, size))
    return LoopDecoder(target, BlockDrafter(target, model, settings, name=METHOD), manifest["info"])


def train(target, settings) -> dict:
    from methods.dflash.training import train_block

    return train_block(target, settings, METHOD)
