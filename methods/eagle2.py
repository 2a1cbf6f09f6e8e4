"""EAGLE-2 (Li et al. 2406.16858): the EAGLE-1 head with a dynamic draft tree.

Each level expands the top_k frontier nodes by draft confidence (summed log-prob), the
best total_token - 1 of all generated nodes are verified (methods/eagle/drafter.py).
Uses the drafter trained by `bench train --method eagle` (`bench train --method eagle2`
trains the same head).

Options: total_token (draft nodes + root), depth (deepest level), top_k, drafter, dtype.
The defaults are sized for a 2-core CPU, where a 16-token verification pass costs a few
one-token steps (results/README.md, hardware profile; EAGLE's GPU default is 60 / 5 / 10).
"""

from __future__ import annotations

from bench.core.decode import LoopDecoder
from methods.eagle import load_head
from methods.eagle.drafter import EagleDrafter, TreeSettings

METHOD = "eagle2"


def dynamic_tree(options: dict) -> TreeSettings:
    defaults = TreeSettings()
    return TreeSettings(mode="dynamic", total_token=int(options.get("total_token", defaults.total_token)),
                        depth=int(options.get("depth", defaults.depth)),
                        top_k=int(options.get("top_k", defaults.top_k)))


def build(target, options: dict) -> LoopDecoder:
    head, manifest = load_head(target, METHOD, options, "eagle1")
    return LoopDecoder(target, EagleDrafter(target, head, dynamic_tree(options), name=METHOD), manifest["info"])


def train(target, settings) -> dict:
    from methods.eagle.training import train_eagle

    return train_eagle(target, settings, "eagle1", "eagle")
