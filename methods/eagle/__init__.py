"""EAGLE-1 (Li et al. 2401.15077): a feature-level autoregressive draft head, static tree.

The head (methods/eagle/model.py) predicts the target's next final hidden state from
(current feature, next token); the target's lm_head turns it into draft tokens. Drafting
(methods/eagle/drafter.py) keeps the head's KV over the committed context and expands a
token tree; training (methods/eagle/training.py) uses cached target features.

    bench train --method eagle            # trains the head for the target (resumable)
    bench run --method eagle --task mtbench
    bench run --method eagle2 ...         # same head, dynamic tree (methods/eagle2.py)

Options: see `Options` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bench.core.decode import LoopDecoder
from bench.core.drafters import WEIGHTS, drafter_info, find_drafter, load_weights_into, open_drafter, read_weights
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, Dtype, option, parse_options
from methods.eagle.drafter import EagleDrafter, TreeSettings, tree_from_accuracy
from methods.eagle.model import EagleConfig, EagleHead

METHOD = "eagle"
CONVENTION = ("SafeAILab EAGLE-1 (eagle/model/cnets1.py): fc([Emb(x_{t+1}); f_t]) -> Llama layer (+ input norm) "
              "-> the target's lm_head; static tree")
EXPORT_FORMATS = ("eagle",)  # speculators (0.9.0) defines no EAGLE-1 layout
DEFAULT_STATIC_NODES = 10
UNMEASURED_RANK_ACCURACY = [0.6, 0.15, 0.07, 0.04, 0.03]


def parse_paths(text: str) -> tuple[tuple[int, ...], ...]:
    """"0;1;0.0" -> ((0,), (1,), (0, 0)): rank paths, each with its parent path."""
    try:
        paths = tuple(tuple(int(r) for r in part.split(".")) for part in text.split(";") if part)
    except ValueError:
        raise BenchError(f"bad tree paths '{text}' (e.g. 0;1;0.0;0.1)") from None
    if not paths:
        raise BenchError("tree paths are empty (e.g. 0;1;0.0;0.1)")
    for path in paths:
        if min(path) < 0:
            raise BenchError(f"static tree path {path} has a negative rank")
        if len(path) > 1 and path[:-1] not in paths:
            raise BenchError(f"static tree path {path} has no parent path {path[:-1]}")
    return paths


@dataclass(frozen=True)
class Options(DraftOptions):
    """drafter: folder (ours or a published EAGLE folder); tree_nodes: static tree size;
    paths: an explicit static tree, e.g. "0;1;0.0;0.1" (overrides tree_nodes); dtype: the
    head's and its lm_head's compute dtype, bfloat16 by default (a draft level reads the
    whole lm_head, so half the bytes is about half the time; the drafter only proposes, so
    its precision changes acceptance, never the output); draft_vocab: FR-Spec, draft over
    the N most frequent tokens of the target's replies (methods/eagle/fr_spec.py; 0: the
    whole vocabulary, EAGLE's convention).

    --budget K: tree_nodes = K (paths may not be given)."""

    drafter: str | None = None
    tree_nodes: int = option(DEFAULT_STATIC_NODES, min=1)
    paths: str | None = None
    dtype: Dtype = "bfloat16"
    draft_vocab: int = option(0, min=0)

    def __post_init__(self) -> None:
        if self.paths is not None:
            parse_paths(self.paths)  # a bad tree fails before the target loads

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"tree_nodes": budget, "paths": None}

    def draft_budget(self) -> int | None:
        return len(parse_paths(self.paths)) if self.paths is not None else self.tree_nodes


def load_head(target, method: str, options, kind: str) -> tuple[EagleHead, dict]:
    """The head for `target` from options.drafter, the user's cache or the shipped folder
    (`options`: any method's Options with drafter and dtype)."""
    from methods.eagle.published import is_published, load_published

    folder = find_drafter(target.name, method if method != "eagle2" else "eagle", options.drafter)
    dtype = getattr(torch, options.dtype)
    if is_published(folder):
        head, manifest = load_published(target, Path(folder), kind)
        manifest = dict(manifest, info=drafter_info(folder, manifest))
        return head.to(device=target.engine.device, dtype=dtype).eval(), manifest
    manifest = open_drafter(target, Path(folder), ("eagle", "eagle3"))
    architecture = manifest.get("architecture", {})
    if architecture.get("kind") != kind:
        raise BenchError(f"drafter {folder} is a {architecture.get('kind')} head, not {kind}")
    try:
        head = EagleHead(EagleConfig(**architecture))
    except TypeError as exc:
        raise BenchError(f"drafter {folder} is not an EAGLE head ({exc})") from None
    weights = read_weights(Path(folder) / manifest.get("weights", WEIGHTS))
    if head.config.shared_lm_head and "draft_to_target" in weights:
        rows = weights["draft_to_target"].long().to(target.engine.lm_head.device)
        weights["lm_head.weight"] = target.engine.lm_head[rows]
    load_weights_into(head, weights, folder)
    manifest = dict(manifest, info=drafter_info(folder, manifest))
    return head.to(device=target.engine.device, dtype=dtype).eval(), manifest


def export(target, drafter: str | None, fmt: str, out: Path, method: str = METHOD, kind: str = "eagle1") -> Path:
    """`bench export --method eagle --format eagle`: the head (ours or a published one) in
    SafeAILab's layout (methods/eagle/published.py), weights exact (bf16 where they are)."""
    from methods.eagle.published import export_published

    head, manifest = load_head(target, method, Options(drafter=drafter, dtype="float32"), kind)
    return export_published(head.cpu(), target, fmt, Path(out), manifest)


def static_tree(manifest: dict, options: Options) -> TreeSettings:
    if options.paths is not None:
        paths = parse_paths(options.paths)
    else:
        # Measured per-rank accuracy of this head, else a generic decaying profile
        # (published heads carry no measurement).
        accuracy = manifest.get("heldout_rank_accuracy", {}).get("step0") or UNMEASURED_RANK_ACCURACY
        paths = tuple(tree_from_accuracy(accuracy, options.tree_nodes))
    return TreeSettings(mode="static", paths=paths)


def draft_vocabulary(target, options, info: dict) -> torch.Tensor | None:
    """FR-Spec's token ids for options.draft_vocab > 0 (recorded in the run's drafter info), else None."""
    if not options.draft_vocab:
        return None
    from methods.eagle.fr_spec import frequent_tokens

    ids, source = frequent_tokens(target, options.draft_vocab)
    info["fr_spec"] = source
    return ids


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    head, manifest = load_head(target, METHOD, opts, "eagle1")
    vocab = draft_vocabulary(target, opts, manifest["info"])
    return LoopDecoder(target, EagleDrafter(target, head, static_tree(manifest, opts), name=METHOD, vocab=vocab),
                       manifest["info"])


def train(target, settings) -> dict:
    from methods.eagle.training import train_eagle

    return train_eagle(target, settings, "eagle1", METHOD)
