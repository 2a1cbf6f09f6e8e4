"""DDTree (Ringel and Romano 2604.12989): a best-first token tree from one DFlash pass.

The DFlash drafter's per-slot distributions are independent of each other, so a tree
over them costs no extra draft passes: nodes are taken in order of summed log-prob
(methods/dflash/drafter.py: ddtree) until the node budget, and the target verifies the
whole tree in one pass with tree attention. Uses the dflash drafter (any layout it
loads), with its convention: under z-lab's, the B-1 mask slots of [root, MASK x (B-1)]
give the tree's levels 1..B-1.

    bench run --method ddtree --task humaneval [--option budget=16]

Options: see `Options` below.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.core.decode import LoopDecoder
from bench.core.options import DraftOptions, Dtype, option, parse_options
from methods.dflash import load_model
from methods.dflash.drafter import BlockDrafter, BlockSettings

METHOD = "ddtree"
CONVENTION = "DDTree (liranringel/ddtree ddtree.py) over the dflash drafter's per-slot top-k; root = the bonus token"


@dataclass(frozen=True)
class Options(DraftOptions):
    """budget: draft nodes per round (16, sized for this CPU's verification costs:
    results/README.md, hardware profile); drafter, dtype: as dflash.

    --budget K: budget = K (the same count: draft nodes, root excluded)."""

    budget: int = option(16, min=1, max=1024)
    drafter: str | None = None
    dtype: Dtype = "bfloat16"

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"budget": budget}

    def draft_budget(self) -> int | None:
        return self.budget


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    model, manifest = load_model(target, "dflash", opts)
    settings = BlockSettings(mode="tree", budget=opts.budget)
    return LoopDecoder(target, BlockDrafter(target, model, settings, name=METHOD), manifest["info"])


def train(target, settings) -> dict:
    from bench.core.errors import BenchError

    raise BenchError("ddtree drafts with the dflash drafter: run `bench train --method dflash`")
