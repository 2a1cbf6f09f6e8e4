"""EAGLE-2 (Li et al. 2406.16858): the EAGLE-1 head with a dynamic draft tree.

Each level expands the top_k frontier nodes by draft confidence (summed log-prob), the
best total_token - 1 of all generated nodes are verified (methods/eagle/drafter.py).
Uses the drafter trained by `bench train --method eagle` (`bench train --method eagle2`
trains the same head).

Options: see `Options` below. The defaults are sized for a 2-core CPU, where a 16-token
verification pass costs a few one-token steps (results/README.md, hardware profile; EAGLE's
GPU default is 60 / 5 / 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.core.decode import LoopDecoder
from bench.core.options import DraftOptions, Dtype, option, parse_options
from methods.eagle import EXPORT_FORMATS, draft_vocabulary, load_head
from methods.eagle.drafter import EagleDrafter, TreeSettings

METHOD = "eagle2"
CONVENTION = "SafeAILab EAGLE-2 (eagle/model/cnets.py topK_genrate): the EAGLE-1 head, dynamic tree"
__all__ = ["CONVENTION", "EXPORT_FORMATS", "METHOD", "Options", "build", "dynamic_tree", "export", "train"]
BUDGET_MAX_DEPTH = 8  # --budget's depth cap: each level is one head pass


@dataclass(frozen=True)
class Options(DraftOptions):
    """total_token: draft nodes + root (EAGLE's convention); depth: deepest draft level;
    top_k: children per expanded node and frontier width; drafter: folder (ours or a
    published one); dtype: the head's compute dtype (bfloat16 by default: it only proposes);
    draft_vocab: FR-Spec, draft over the N most frequent tokens of the target's replies
    (methods/eagle/fr_spec.py; 0: the whole vocabulary, EAGLE's convention). EAGLE-3
    (methods/eagle3.py) takes the same options but draft_vocab (it has its own).

    --budget K: total_token = K + 1 and depth = min(K, 8) (an explicit depth wins). At most
    top_k + (depth-1) top_k^2 nodes are generated, so a large K with a shallow tree verifies
    fewer than K."""

    total_token: int = option(TreeSettings.total_token, min=2)
    depth: int = option(TreeSettings.depth, min=1)
    top_k: int = option(TreeSettings.top_k, min=1)
    drafter: str | None = None
    dtype: Dtype = "bfloat16"
    draft_vocab: int = option(0, min=0)

    BUDGET_SOFT = ("depth",)

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"total_token": budget + 1, "depth": min(budget, BUDGET_MAX_DEPTH)}

    def draft_budget(self) -> int | None:
        return self.total_token - 1

    def most_draft_tokens(self) -> int:
        """The nodes its levels generate at most: top_k, then top_k^2 at each deeper level."""
        return self.top_k + (self.depth - 1) * self.top_k ** 2


def dynamic_tree(options: Options) -> TreeSettings:
    return TreeSettings(mode="dynamic", total_token=options.total_token, depth=options.depth, top_k=options.top_k)


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    head, manifest = load_head(target, METHOD, opts, "eagle1")
    vocab = draft_vocabulary(target, opts, manifest["info"])
    return LoopDecoder(target, EagleDrafter(target, head, dynamic_tree(opts), name=METHOD, vocab=vocab),
                       manifest["info"])


def export(target, drafter: str | None, fmt: str, out: Path) -> Path:
    """The EAGLE-1 head eagle2 drafts with, as `bench export --method eagle` writes it."""
    from methods.eagle import export as export_eagle

    return export_eagle(target, drafter, fmt, out, METHOD)


def train(target, settings) -> dict:
    from methods.eagle.training import train_eagle

    return train_eagle(target, settings, "eagle1", "eagle")
