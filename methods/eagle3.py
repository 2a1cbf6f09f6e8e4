"""EAGLE-3 (Li et al. 2503.01840): fused low/mid/high target features, training-time
test, own lm_head over a reduced draft vocabulary, dynamic tree as EAGLE-2.

    bench train --method eagle3 [--option ttt_steps=4 --option draft_vocab=16384]
    bench run --method eagle3 --task mtbench [--option total_token=12 --option depth=5 --option top_k=4]

The draft vocabulary (the most frequent reply tokens of the training data) shrinks the
head's lm_head, which dominates a draft step for a small target (on SmolLM2-135M the full
projection's share of a target step is in results/README.md).
"""

from __future__ import annotations

from pathlib import Path

from bench.core.decode import LoopDecoder
from bench.core.errors import BenchError
from bench.core.options import parse_options
from methods.eagle import load_head
from methods.eagle.drafter import EagleDrafter
from methods.eagle2 import Options, dynamic_tree

METHOD = "eagle3"
CONVENTION = ("SafeAILab EAGLE-3 (eagle/model/cnets.py): taps 2, L/2, L-3 fused by fc, own lm_head over a draft "
              "vocabulary (d2t); speculators eagle3 variants as flags")
EXPORT_FORMATS = ("eagle", "speculators")
__all__ = ["CONVENTION", "EXPORT_FORMATS", "METHOD", "Options", "build", "export", "train"]
# Options: EAGLE-2's (total_token, depth, top_k, ...)


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    if opts.draft_vocab:
        raise BenchError("eagle3 drafts over its own trained draft vocabulary: draft_vocab (FR-Spec) is an "
                         "eagle / eagle2 option")
    head, manifest = load_head(target, METHOD, opts, "eagle3")
    return LoopDecoder(target, EagleDrafter(target, head, dynamic_tree(opts), name=METHOD), manifest["info"])


def export(target, drafter: str | None, fmt: str, out: Path) -> Path:
    """`bench export --method eagle3 --format eagle|speculators`: SafeAILab's layout or vLLM
    speculators' (methods/eagle/published.py), with the head's own lm_head rows, d2t and t2d."""
    from methods.eagle import export as export_eagle

    return export_eagle(target, drafter, fmt, out, METHOD, "eagle3")


def train(target, settings) -> dict:
    from methods.eagle.training import train_eagle

    return train_eagle(target, settings, "eagle3", METHOD)
