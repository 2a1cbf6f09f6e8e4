"""SpecInfer token trees (Miao et al. 2305.09781): a small draft model expands a token tree,
level by level, and the target verifies the whole tree in one pass with tree attention.

Expansion: `widths` gives the number of children per node at each depth (default 2,2,2,1:
up to 2+4+8+8 = 22 nodes, depth 4). Each level is one draft forward over the frontier,
every node seeing the committed context and its own ancestors (a mask over every slot).

Children are either
- "topk": the draft's top-k tokens, deterministic (q one-hot): exact at any temperature
  through the deterministic-tree rule; the default, and the only choice when greedy;
- "sample": i.i.d. draws from the draft's warped distribution q, verified with SpecInfer's
  multi-step speculative sampling;
- "sample_wor": draws without replacement, verified with recursive rejection sampling.
The draft model is the SpS drafter (`bench train --method sps`, or --drafter PATH).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft
from bench.core.drafters import find_drafter
from bench.core.engine import Engine, ForwardOutput
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, option, parse_options
from bench.core.sampling import process_logits
from bench.core.verify import WITHOUT_REPLACEMENT
from methods.sps import load_draft_engine

METHOD = "specinfer"
MODES = ("topk", "sample", "sample_wor")
# Generic chance that the draft's rank-r child is the target's token (no measurement is
# stored for the SpS draft); it only ranks tree shapes for --budget.
PRIOR_RANK_ACCURACY = (0.6, 0.15, 0.07, 0.04, 0.03)
BUDGET_DEPTH = 4  # the default tree's depth: a level is one draft pass


def tree_nodes(widths: tuple[int, ...]) -> int:
    """Draft nodes of a tree with `widths` children per node at each depth."""
    total, frontier = 0, 1
    for width in widths:
        frontier *= width
        total += frontier
    return total


@cache
def _shapes(nodes: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """Every widths tuple of at most `depth` levels with exactly `nodes` nodes:
    nodes = w1 * (1 + nodes of the rest)."""
    found = [(nodes,)]
    if depth > 1:
        for width in range(1, nodes):
            if nodes % width == 0 and nodes // width > 1:
                found += [(width, *rest) for rest in _shapes(nodes // width - 1, depth - 1)]
    return tuple(found)


def widths_for_budget(budget: int) -> tuple[int, ...]:
    """The widths with exactly `budget` nodes, at most BUDGET_DEPTH levels, and the most
    expected accepted drafts under PRIOR_RANK_ACCURACY (sum over depths of the product of
    each level's top-w accuracy); ties to the shallower. Gives the default 2,2,2,1 for 22."""
    def value(widths: tuple[int, ...]) -> float:
        total, path = 0.0, 1.0
        for width in widths:
            path *= sum(PRIOR_RANK_ACCURACY[:width])
            total += path
        return total

    return max(_shapes(budget, BUDGET_DEPTH), key=lambda w: (value(w), -len(w), w))


@dataclass(frozen=True)
class Options(DraftOptions):
    """widths: children per node at each depth; mode: topk | sample | sample_wor (see above);
    drafter: the SpS draft model's folder (default: user-trained, then shipped).

    --budget K: widths_for_budget(K), a tree of exactly K nodes at most 4 levels deep
    (4 -> 1,1,1,1; 8 -> 2,1,1,1; 16 -> 4,1,1,1; 22 -> 2,2,2,1)."""

    widths: tuple[int, ...] = option((2, 2, 2, 1), min=1)
    mode: Literal["topk", "sample", "sample_wor"] = "topk"
    drafter: str | None = None

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"widths": widths_for_budget(budget)}

    def draft_budget(self) -> int | None:
        return tree_nodes(self.widths)


class SpecInferDrafter(Drafter):
    name = "specinfer"

    def __init__(self, draft: Engine, widths: tuple[int, ...] = (2, 2, 2, 1), mode: str = "topk") -> None:
        if mode not in MODES:
            raise BenchError(f"specinfer mode '{mode}' unknown (choose from {', '.join(MODES)})")
        if not widths or min(widths) < 1:
            raise BenchError("specinfer widths must be positive integers, e.g. 2,2,2,1")
        self.draft = draft
        self.widths = tuple(widths)
        self.mode = mode
        self.seen = 0  # committed tokens held in the draft's KV cache

    def fork(self) -> Drafter:
        twin = super().fork()
        twin.draft = self.draft.fork()  # the draft model's KV cache is per request
        return twin

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.draft.prefill(torch.tensor(state.tokens[: state.prompt_len]), logits_rows="none")
        self.seen = state.prompt_len

    def _children(self, logits: torch.Tensor, width: int, state: DecodeState) -> tuple[list[int], torch.Tensor | None]:
        cfg = state.config.sampling
        if cfg.greedy or self.mode == "topk":
            return logits.topk(width).indices.tolist(), None
        q = process_logits(logits, cfg).softmax(-1)
        replacement = self.mode == "sample"
        width = width if replacement else min(width, int((q > 0).sum()))
        tokens = torch.multinomial(q, width, replacement=replacement, generator=state.generator).tolist()
        return tokens, q

    def propose(self, state: DecodeState) -> Draft:
        base = len(state.tokens)  # committed tokens, root included: all in the draft cache after this feed
        room = state.config.max_new_tokens - len(state.generated) - 1
        depth_limit = min(len(self.widths), room)
        if depth_limit < 1:
            return Draft.empty()
        logits = self.draft.forward(torch.tensor(state.tokens[self.seen:]), logits_rows="last").logits
        tokens: list[int] = []
        parents: list[int] = []
        q_rows: list[torch.Tensor | None] = []
        ancestors: list[list[int]] = []  # per node: node indices on its path, itself included
        frontier = [-1]  # nodes whose children come next; -1 = the root
        for depth in range(depth_limit):
            new_frontier = []
            for row, parent in enumerate(frontier):
                children, q = self._children(logits[row], self.widths[depth], state)
                for token in children:
                    node = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                    q_rows.append(q)
                    ancestors.append((ancestors[parent] if parent >= 0 else []) + [node])
                    new_frontier.append(node)
            frontier = new_frontier
            if depth + 1 == depth_limit:
                break
            # One draft pass over the new level; slot of node i = base + i.
            total = base + frontier[-1] + 1
            mask = torch.zeros(len(frontier), total, dtype=torch.bool)
            mask[:, :base] = True
            for row, node in enumerate(frontier):
                mask[row, [base + a for a in ancestors[node]]] = True
            self.draft.crop(base + frontier[0])  # slots of earlier levels stay; this level starts here
            positions = torch.tensor([base + depth for _ in frontier])  # root at base-1, depth d at base-1+d+1
            logits = self.draft.forward(torch.tensor([tokens[n] for n in frontier]), positions, mask).logits
        self.draft.crop(base)  # tree KV is dropped; accepted tokens are re-fed next round
        self.seen = base
        sampled = q_rows and q_rows[0] is not None
        draft = Draft(tokens=tokens, parents=parents, q=torch.stack(q_rows) if sampled else None,
                      sampled_children=bool(sampled))
        if sampled and self.mode == "sample_wor":
            draft.meta[WITHOUT_REPLACEMENT] = True
        return draft


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    draft, info = load_draft_engine(target, find_drafter(target.name, "sps", opts.drafter))
    # The SpS draft's identity goes into the records: a retrained draft makes a new grid revision.
    return LoopDecoder(target, SpecInferDrafter(draft, opts.widths, opts.mode), info)


def train(target, settings) -> dict:
    raise BenchError("specinfer drafts with the SpS draft model: run `bench train --method sps`")
