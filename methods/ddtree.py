"""DDTree (Ringel and Romano 2604.12989): a best-first token tree from one DFlash pass.

The DFlash drafter's per-slot distributions are independent of each other, so a tree
over them costs no extra draft passes: nodes are taken in order of summed log-prob
(methods/dflash/drafter.py: ddtree) until the node budget, and the target verifies the
whole tree in one pass with tree attention. Uses the dflash drafter.

    bench run --method ddtree --task humaneval [--option budget=16]

Options: drafter, dtype (as dflash), budget (draft nodes per round, default 16, sized for
this CPU's verification costs: results/README.md, hardware profile).
"""

from __future__ import annotations

from bench.core.decode import LoopDecoder
from methods.dflash import int_option, load_model
from methods.dflash.drafter import BlockDrafter, BlockSettings

METHOD = "ddtree"
DEFAULT_BUDGET = 16


def build(target, options: dict) -> LoopDecoder:
    model, manifest = load_model(target, "dflash", options)
    settings = BlockSettings(mode="tree", budget=int_option(options, "budget", DEFAULT_BUDGET, 1, 1024))
    return LoopDecoder(target, BlockDrafter(target, model, settings, name=METHOD), manifest["info"])


def train(target, settings) -> dict:
    from bench.core.errors import BenchError

    raise BenchError("ddtree drafts with the dflash drafter: run `bench train --method dflash`")
