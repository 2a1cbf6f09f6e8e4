"""Medusa's static token tree: node values from measured per-head top-k accuracy,
best-first selection, a device-sized cut, and the Tree the drafter fills each round."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.core.draft import Draft
from bench.core.errors import BenchError

TOPK = 10  # ranks per head the tree may use, and the top-k accuracies measured
# Rough top-1 agreement per head for published heads that carry no measurements; rank k
# then gets top1 * 0.4^(k-1). Only used to shape a tree when nothing better is known.
PRIOR_TOP1 = (0.6, 0.42, 0.3, 0.21, 0.15)


def rank_probabilities(topk_accuracy: list[list[float]]) -> list[list[float]]:
    """Cumulative top-k accuracy per head -> P(the rank-k token is the right one)."""
    out = []
    for row in topk_accuracy:
        previous = 0.0
        ranks = []
        for value in row:
            ranks.append(max(0.0, value - previous))
            previous = max(previous, value)
        out.append(ranks)
    return out


def prior_accuracy(num_heads: int) -> list[list[float]]:
    """Cumulative top-k accuracies from PRIOR_TOP1 (heads beyond it decay by 0.7)."""
    table = []
    for i in range(num_heads):
        top1 = PRIOR_TOP1[i] if i < len(PRIOR_TOP1) else PRIOR_TOP1[-1] * 0.7 ** (i + 1 - len(PRIOR_TOP1))
        table.append([top1 * (1 - 0.4 ** k) / 0.6 for k in range(1, TOPK + 1)])
    return table


def path_value(path: tuple[int, ...], ranks: list[list[float]]) -> float:
    value = 1.0
    for depth, rank in enumerate(path):
        value *= ranks[depth][rank]
    return value


def expected_accepted(paths: list[tuple[int, ...]], topk_accuracy: list[list[float]]) -> float:
    """Expected accepted drafts per round under independent heads: sum of node values."""
    ranks = rank_probabilities(topk_accuracy)
    return sum(path_value(tuple(p), ranks) for p in paths)


def build_tree(topk_accuracy: list[list[float]], size: int = 63, topk: int = TOPK) -> list[tuple[int, ...]]:
    """The `size` nodes (rank paths) with the largest acceptance probability, best first.
    A child is never worth more than its parent, so best-first expansion from the root
    keeps the set connected and maximises the expected accepted length."""
    ranks = rank_probabilities(topk_accuracy)
    depth_limit = len(ranks)
    frontier = [(-path_value((k,), ranks), (k,)) for k in range(min(topk, len(ranks[0])))] if ranks else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < size:
        _, path = heapq.heappop(frontier)  # ties: the smaller path (lower ranks, shallower) first
        chosen.append(path)
        if len(path) < depth_limit:
            for k in range(min(topk, len(ranks[len(path)]))):
                child = path + (k,)
                heapq.heappush(frontier, (-path_value(child, ranks), child))
    return chosen


@dataclass(frozen=True)
class Tree:
    """A static tree in topological order: nodes sorted by (depth, path)."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    heads: Tensor  # [n] head index (= depth - 1) per node
    ranks: Tensor  # [n] rank within that head's top-k
    depth_ends: tuple[int, ...]  # depth_ends[d-1] = number of nodes of depth <= d

    @classmethod
    def from_paths(cls, paths, num_heads: int) -> Tree:
        try:
            ordered = sorted({tuple(int(k) for k in p) for p in paths}, key=lambda p: (len(p), p))
        except (TypeError, ValueError):
            raise BenchError("medusa choices must be a list of rank lists, e.g. [[0], [1], [0, 0]]") from None
        index = {p: i for i, p in enumerate(ordered)}
        parents = []
        for p in ordered:
            if not p or len(p) > num_heads or min(p) < 0 or max(p) >= TOPK:
                raise BenchError(f"medusa tree path {list(p)}: need 1..{num_heads} ranks, each in 0..{TOPK - 1}")
            if len(p) > 1 and p[:-1] not in index:
                raise BenchError(f"medusa tree path {list(p)} lacks its parent {list(p[:-1])}")
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        depth = max((len(p) for p in ordered), default=0)
        ends = tuple(sum(1 for p in ordered if len(p) <= d) for d in range(1, depth + 1))
        return cls(paths=tuple(ordered), parents=tuple(parents),
                   heads=torch.tensor([len(p) - 1 for p in ordered], dtype=torch.long),
                   ranks=torch.tensor([p[-1] for p in ordered], dtype=torch.long), depth_ends=ends)

    @property
    def depth(self) -> int:
        return len(self.depth_ends)

    def draft(self, topk_tokens: Tensor, max_depth: int) -> Draft:
        """Fill the tree from each head's top-k tokens [heads, >= max rank + 1], cut at max_depth."""
        depth = min(self.depth, max_depth)
        if depth < 1:
            return Draft.empty()
        n = self.depth_ends[depth - 1]
        tokens = topk_tokens[self.heads[:n], self.ranks[:n]].tolist()
        return Draft(tokens=tokens, parents=list(self.parents[:n]))


def device_sized_tree(target, accuracy: list[list[float]], largest: int = 64) -> list[tuple[int, ...]]:
    """The best-first tree cut where expected tokens per second peak on this device: node
    values come from the measured head accuracies, t_v(k) from the stored `bench profile` of
    this machine, else from a few seconds of timing (the heads' own cost is one pass,
    whatever the tree size, so it does not move the cut)."""
    from bench.core.costs import best_size, quick_chain_costs, stored_chain_costs

    paths = build_tree(accuracy, largest)
    ranks = rank_probabilities(accuracy)
    gains = [0.0]
    for path in paths:
        gains.append(gains[-1] + path_value(tuple(path), ranks))
    costs = stored_chain_costs(target, len(paths) + 1) or quick_chain_costs(target.engine, len(paths) + 1)
    size = best_size(gains, costs)
    return paths[: max(1, size)]

