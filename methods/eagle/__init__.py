"""EAGLE-1 (Li et al. 2401.15077): a feature-level autoregressive draft head, static tree.

The head (methods/eagle/model.py) predicts the target's next final hidden state from
(current feature, next token); the target's lm_head turns it into draft tokens. Drafting
(methods/eagle/drafter.py) keeps the head's KV over the committed context and expands a
token tree; training (methods/eagle/training.py) uses cached target features.

    bench train --method eagle            # trains the head for the target (resumable)
    bench run --method eagle --task mtbench
    bench run --method eagle2 ...         # same head, dynamic tree (methods/eagle2.py)

Options: drafter (folder; ours or a published EAGLE folder), tree_nodes (static tree size,
default 10), paths (explicit static tree, e.g. "0;1;0.0;0.1"), dtype (the head's and
its lm_head's compute dtype, default bfloat16: a draft level reads the whole lm_head, so
half the bytes is about half the time; the drafter only proposes, so its precision changes
acceptance, never the output).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.core.decode import LoopDecoder
from bench.core.drafters import WEIGHTS, drafter_info, find_drafter, load_weights_into, open_drafter, read_weights
from bench.core.errors import BenchError
from methods.eagle.drafter import EagleDrafter, TreeSettings, tree_from_accuracy
from methods.eagle.model import EagleConfig, EagleHead

METHOD = "eagle"
DEFAULT_STATIC_NODES = 10
UNMEASURED_RANK_ACCURACY = [0.6, 0.15, 0.07, 0.04, 0.03]


def load_head(target, method: str, options: dict, kind: str) -> tuple[EagleHead, dict]:
    """The head for `target` from options["drafter"], the user's cache or the shipped folder."""
    from methods.eagle.published import is_published, load_published

    folder = find_drafter(target.name, method if method != "eagle2" else "eagle", options.get("drafter"))
    dtype = getattr(torch, str(options.get("dtype", "bfloat16")))
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
    load_weights_into(head, read_weights(Path(folder) / manifest.get("weights", WEIGHTS)), folder)
    manifest = dict(manifest, info=drafter_info(folder, manifest))
    return head.to(device=target.engine.device, dtype=dtype).eval(), manifest


def parse_paths(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        return tuple(tuple(int(r) for r in part.split(".")) for part in text.split(";") if part)
    except ValueError:
        raise BenchError(f"bad tree paths '{text}' (e.g. 0;1;0.0;0.1)") from None


def static_tree(manifest: dict, options: dict) -> TreeSettings:
    if "paths" in options:
        paths = parse_paths(str(options["paths"]))
    else:
        # Measured per-rank accuracy of this head, else a generic decaying profile
        # (published heads carry no measurement).
        accuracy = manifest.get("heldout_rank_accuracy", {}).get("step0") or UNMEASURED_RANK_ACCURACY
        paths = tuple(tree_from_accuracy(accuracy, int(options.get("tree_nodes", DEFAULT_STATIC_NODES))))
    for path in paths:
        if len(path) > 1 and path[:-1] not in paths:
            raise BenchError(f"static tree path {path} has no parent path {path[:-1]}")
    return TreeSettings(mode="static", paths=paths)


def build(target, options: dict) -> LoopDecoder:
    head, manifest = load_head(target, METHOD, options, "eagle1")
    return LoopDecoder(target, EagleDrafter(target, head, static_tree(manifest, options), name=METHOD),
                       manifest["info"])


def train(target, settings) -> dict:
    from methods.eagle.training import train_eagle

    return train_eagle(target, settings, "eagle1", METHOD)
