"""The one draft representation every method proposes: a token tree (a chain is a tree).

Nodes are numbered 0..n-1 in topological order (a parent comes before its children).
The root, the last committed token, is not a draft node: it is the first input of the
verification pass and carries index -1 in `parents`. `q` holds, per node, the exact
distribution the node's token was sampled from; None means deterministic drafts
(argmax, top-k, n-gram), which verification treats as one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]
    q: Tensor | None = None  # [n, V]
    sampled_children: bool = False  # siblings drawn i.i.d. from q (SpecInfer multi-draft)
    meta: dict = field(default_factory=dict)  # extras; bench.core.verify reads meta[WITHOUT_REPLACEMENT]
    # Optional extra branch run in the same target pass but never accepted (Lookahead's
    # Jacobi window): tokens, positions relative to the root's, and a mask [m, n+1+m] over
    # the whole block ([root, drafts..., extras...]). Their logits reach Drafter.learn;
    # their KV is dropped by the commit.
    extra_tokens: list[int] = field(default_factory=list)
    extra_positions: list[int] = field(default_factory=list)
    extra_mask: Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: not topological order")

    @classmethod
    def chain(cls, tokens: list[int], q: Tensor | None = None) -> Draft:
        return cls(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), q=q)

    @classmethod
    def empty(cls) -> Draft:
        return cls(tokens=[], parents=[])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node; the root has depth 0, its children 1."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def verify_inputs(self, root: int, start: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Tokens [root, drafts...], RoPE positions start+depth, and the tree mask
        (None for a chain: plain causal). Row i of the mask sees its ancestors and itself."""
        tokens = torch.tensor([root] + self.tokens + self.extra_tokens, dtype=torch.long)
        positions = torch.tensor([0] + self.depths() + self.extra_positions, dtype=torch.long) + start
        if self.is_chain and not self.extra_tokens:
            return tokens, positions, None
        size = len(self.tokens) + 1
        mask = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
        mask[0, 0] = True
        for i, parent in enumerate(self.parents, start=1):
            mask[i] = mask[parent + 1]
            mask[i, i] = True
        if self.extra_tokens:
            mask[size:] = self.extra_mask
        return tokens, positions, mask
