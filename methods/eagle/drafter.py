"""EAGLE drafting at decode time: the head's context cache and the draft tree.

Context. Row t of the head's cache holds the pair (target feature at t, token t+1); its
output predicts the feature at t+1, whose logits give token t+2. After each verify pass
the committed rows' features arrive in `accept` and become context rows at the next
`propose` (EAGLE's `stable_kv`); tree rows are dropped each round.

Trees. A depth-d node sits at position (last context position + d) and sees the
context plus its ancestors. Two shapes:
- static (EAGLE-1): a fixed set of paths of ranks, e.g. (0,), (1,), (0, 0): the k-th
  best child at each level; built from measured per-rank acceptance (see tree_from_accuracy).
- dynamic (EAGLE-2): expand the top_k best frontier nodes per level (score = summed draft
  log-prob), keep the best `total_token - 1` of all generated nodes, parents first.
Children are top-k (deterministic), so the shared verifier is lossless at any temperature.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.decode import DecodeState, Drafter
from bench.core.draft import Draft
from bench.core.engine import ForwardOutput
from bench.core.verify import Verdict
from methods.eagle.model import EagleHead


@dataclass
class TreeSettings:
    mode: str = "dynamic"  # "dynamic" (EAGLE-2) | "static" (EAGLE-1)
    total_token: int = 12  # dynamic: draft nodes + root (EAGLE's convention)
    depth: int = 5  # dynamic: deepest draft level
    top_k: int = 4  # dynamic: children per expanded node and frontier width
    paths: tuple[tuple[int, ...], ...] = ()  # static: rank paths


def tree_from_accuracy(rank_accuracy: list[float], nodes: int, max_depth: int = 6) -> list[tuple[int, ...]]:
    """The `nodes` rank paths with the highest expected acceptance, assuming the chance
    that the rank-r child is right is rank_accuracy[r] at every level, independently:
    value(path) = prod(rank_accuracy[r] for r in path). Best-first, so every chosen
    path's prefix is chosen too (a child's value never exceeds its parent's)."""
    heap = [(-rank_accuracy[r], (r,)) for r in range(len(rank_accuracy))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        value, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:
            for r, accuracy in enumerate(rank_accuracy):
                heapq.heappush(heap, (value * accuracy, path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


class _Tree:
    """Nodes generated while drafting: token, parent (-1 = root), cumulative log-prob,
    depth, and for nodes run through the head: cache row and output."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depths: list[int] = []
        self.rows: dict[int, int] = {}
        self.outputs: dict[int, Tensor] = {}

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def ancestors(self, node: int) -> list[int]:
        chain = []
        while node >= 0:
            chain.append(node)
            node = self.parents[node]
        return chain

    def to_draft(self, keep: list[int]) -> Draft:
        """Draft of the kept nodes (ancestor-closed), parents before children."""
        kept = set()
        for node in keep:
            kept.update(self.ancestors(node))
        order = sorted(kept, key=lambda n: (self.depths[n], n))
        index = {node: i for i, node in enumerate(order)}
        return Draft([self.tokens[n] for n in order], [index.get(self.parents[n], -1) for n in order])


class EagleDrafter(Drafter):
    def __init__(self, target, head: EagleHead, tree: TreeSettings, name: str = "eagle") -> None:
        self.name = name
        self.head = head.eval().requires_grad_(False)
        self.tree = tree
        self.taps = tuple(head.config.taps)
        self.dtype = head.q_proj.weight.dtype
        self.embed = target.engine.embed
        # EAGLE-1/2 project with the target's lm_head; a copy in the head's dtype (bf16 by
        # default) halves the bytes each draft level reads.
        self.lm_head = target.engine.lm_head.to(self.dtype)
        self.cache = head.new_cache()
        self.context_rows = 0  # cache rows that are context (the rest are last round's tree)
        self.pending: tuple[list[Tensor], list[int]] = ([], [])  # features and next tokens not yet in the cache
        self.last_out: Tensor | None = None

    # ------------------------------------------------------------ context
    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.cache = self.head.new_cache()
        self.context_rows = 0
        self.pending = ([prefill.hidden[t] for t in self.taps], state.tokens[1:])

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        index = torch.tensor(rows, device=out.logits.device)
        self.pending = ([out.hidden[t][index] for t in self.taps], state.tokens[-len(rows):])

    def _embed(self, tokens: list[int]) -> Tensor:
        return F.embedding(torch.tensor(tokens, device=self.embed.device), self.embed).to(self.dtype)

    def _log_probs(self, out: Tensor) -> tuple[Tensor, Tensor]:
        """Draft log-probs [n, Vd] and the target ids of the draft vocabulary [Vd]."""
        logits = self.head.logits(out, self.lm_head).float()
        if self.head.config.kind == "eagle3":
            return logits.log_softmax(-1), self.head.draft_to_target
        return logits.log_softmax(-1), torch.arange(logits.shape[-1], device=logits.device)

    def _extend_context(self) -> Tensor:
        """Run the pending committed rows; returns the output of the last one."""
        self.cache.crop(self.context_rows)  # drop last round's tree rows
        features, tokens = self.pending
        embeds = self._embed(tokens)
        with torch.inference_mode():
            hidden = self.head.fuse([f.to(self.dtype) for f in features], embeds)
            positions = torch.arange(self.context_rows, self.context_rows + len(tokens), device=hidden.device)
            out = self.head.step(hidden, embeds, positions, self.cache)
        self.context_rows = self.cache.length
        return out[-1]

    # --------------------------------------------------------------- tree
    def _run_nodes(self, tree: _Tree, nodes: list[int], root_out: Tensor) -> Tensor:
        """Run `nodes` (all of one depth) through the head; returns their log-probs."""
        tokens = [tree.tokens[n] for n in nodes]
        embeds = self._embed(tokens)
        parent_out = torch.stack([root_out if tree.parents[n] < 0 else tree.outputs[tree.parents[n]] for n in nodes])
        with torch.inference_mode():
            hidden = parent_out if self.head.config.kind == "eagle3" else self.head.fuse([parent_out], embeds)
            start = self.cache.length
            visible = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool, device=hidden.device)
            visible[:, : self.context_rows] = True
            for i, node in enumerate(nodes):
                for ancestor in tree.ancestors(tree.parents[node]):
                    visible[i, tree.rows[ancestor]] = True
                visible[i, start + i] = True
            positions = torch.tensor([self.context_rows - 1 + tree.depths[n] for n in nodes], device=hidden.device)
            out = self._step_visible(hidden, embeds, positions, visible)
        for i, node in enumerate(nodes):
            tree.rows[node] = start + i
            tree.outputs[node] = out[i]
        return self._log_probs(out)[0]

    def _step_visible(self, hidden: Tensor, embeds: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        """head.step with a mask over every cache row (tree levels see their ancestors)."""
        return self.head.step(hidden, embeds, positions, self.cache, visible=visible,
                              scale=self.head.config.head_dim ** -0.5)

    def propose(self, state: DecodeState) -> Draft:
        root_out = self._extend_context()
        log_probs, vocab = self._log_probs(root_out[None])
        if self.tree.mode == "static":
            return self._static(log_probs[0], vocab, root_out)
        return self._dynamic(log_probs[0], vocab, root_out)

    def _dynamic(self, root_log_probs: Tensor, vocab: Tensor, root_out: Tensor) -> Draft:
        settings = self.tree
        tree = _Tree()
        values, ids = root_log_probs.topk(settings.top_k)
        frontier = [tree.add(int(vocab[i]), -1, float(v)) for v, i in zip(values, ids)]
        for _ in range(settings.depth - 1):
            log_probs = self._run_nodes(tree, frontier, root_out)
            values, ids = log_probs.topk(settings.top_k, dim=-1)
            candidates = []
            for row, node in enumerate(frontier):
                base = tree.scores[node]
                candidates += [tree.add(int(vocab[i]), node, base + float(v)) for v, i in zip(values[row], ids[row])]
            frontier = sorted(candidates, key=lambda n: -tree.scores[n])[: settings.top_k]
        best = sorted(range(len(tree.tokens)), key=lambda n: (-tree.scores[n], n))[: settings.total_token - 1]
        return tree.to_draft(best)

    def _static(self, root_log_probs: Tensor, vocab: Tensor, root_out: Tensor) -> Draft:
        paths = self.tree.paths
        tree = _Tree()
        node_of: dict[tuple[int, ...], int] = {}
        ranked = root_log_probs.topk(1 + max(p[0] for p in paths)).indices
        for path in paths:
            if len(path) == 1:
                node_of[path] = tree.add(int(vocab[ranked[path[0]]]), -1, 0.0)
        depth = 1
        while True:
            parents = sorted({p[:-1] for p in paths if len(p) == depth + 1 and p[:-1] in node_of})
            if not parents:
                break
            nodes = [node_of[p] for p in parents]
            log_probs = self._run_nodes(tree, nodes, root_out)
            widest = 1 + max(p[-1] for p in paths if len(p) == depth + 1)
            ranked = log_probs.topk(widest, dim=-1).indices
            for row, parent in enumerate(parents):
                for path in paths:
                    if len(path) == depth + 1 and path[:-1] == parent:
                        node_of[path] = tree.add(int(vocab[ranked[row, path[-1]]]), node_of[parent], 0.0)
            depth += 1
        return tree.to_draft(list(node_of.values()))
