"""Verification: which draft nodes the target accepts, and the one extra token.

Input: a Draft and the target's logits at every verified position (row 0 = the root,
row i+1 = draft node i). Output: the accepted root-to-node path and the next token
(correction or bonus). Rules follow Leviathan et al. / SpecInfer; see the comments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bench.draft import Draft
from bench.sampling import SamplingConfig, process_logits, sample_from


@dataclass
class Verdict:
    accepted: list[int]  # draft node indices on the accepted path, root excluded
    next_token: int  # correction (first rejection) or bonus (all accepted)


def _children(draft: Draft) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(draft.parents):
        children.setdefault(parent, []).append(node)
    return children


def verify(draft: Draft, logits: Tensor, cfg: SamplingConfig,
           generator: torch.Generator | None = None) -> Verdict:
    """Dispatch to the rule that keeps the output distributed exactly as the target's."""
    if cfg.greedy:
        return verify_greedy(draft, logits)
    if draft.q is None:
        return verify_deterministic(draft, logits, cfg, generator)
    raise NotImplementedError("sampled drafts (q given) need bench.verify's sampling rules")


def verify_greedy(draft: Draft, logits: Tensor) -> Verdict:
    """Walk from the root while some child carries the target's argmax."""
    targets = logits.argmax(-1).tolist()
    children = _children(draft)
    accepted: list[int] = []
    row = 0  # logits row of the current node (root)
    node = -1
    while True:
        wanted = targets[row]
        match = next((c for c in children.get(node, []) if draft.tokens[c] == wanted), None)
        if match is None:
            return Verdict(accepted, wanted)
        accepted.append(match)
        node, row = match, match + 1


def verify_deterministic(draft: Draft, logits: Tensor, cfg: SamplingConfig,
                         generator: torch.Generator | None) -> Verdict:
    """Sampling with deterministic children (q one-hot): draw y ~ p(node); descend if a
    child carries y, else emit y. Exact because the tree does not depend on the draw."""
    probs = process_logits(logits, cfg).softmax(-1)
    children = _children(draft)
    accepted: list[int] = []
    row, node = 0, -1
    while True:
        drawn = sample_from(probs[row], generator)
        match = next((c for c in children.get(node, []) if draft.tokens[c] == drawn), None)
        if match is None:
            return Verdict(accepted, drawn)
        accepted.append(match)
        node, row = match, match + 1
