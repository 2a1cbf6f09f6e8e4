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
    """Nodes generated while drafting, in fixed-size device buffers (no host round trip
    until the finished draft): token, parent (-1 = root), cumulative log-prob (fp64, so
    sums and ties order as exact host arithmetic would), depth, the node's output, and
    which of the round's tree rows in the head's cache it sees (its ancestors' and its own)."""

    def __init__(self, capacity: int, tree_rows: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
        self.size = 0
        self.rows = 0  # tree rows run through the head so far
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros(capacity, dtype=torch.float64, device=device)
        self.depths = torch.zeros(capacity, dtype=torch.long, device=device)
        self.outputs = torch.zeros(capacity + 1, width, dtype=dtype, device=device)  # row 0: the root's
        self.sees = torch.zeros(capacity + 1, tree_rows, dtype=torch.bool, device=device)  # row 0: the root's

    def add(self, tokens: Tensor, parents: Tensor, scores: Tensor) -> Tensor:
        """Append nodes (tensors [m]); returns their indices."""
        index = torch.arange(self.size, self.size + len(tokens), device=tokens.device)
        self.tokens[index], self.parents[index], self.scores[index] = tokens, parents, scores
        self.depths[index] = torch.where(parents < 0, 1, self.depths[parents.clamp(min=0)] + 1)
        self.size += len(tokens)
        return index

    def to_draft(self, keep: Tensor) -> Draft:
        """Draft of the kept nodes (ancestor-closed), parents before children: one host copy."""
        order = keep[torch.sort(self.depths[keep] * self.size + keep, stable=True).indices]
        position = torch.full((self.size,), -1, dtype=torch.long, device=keep.device)
        position[order] = torch.arange(len(order), device=keep.device)
        parents = self.parents[order]
        parents = torch.where(parents < 0, -1, position[parents.clamp(min=0)])
        tokens, parents = torch.stack([self.tokens[order], parents]).tolist()
        return Draft(tokens, parents)


class EagleDrafter(Drafter):
    """`vocab`: EAGLE-1/2 draft over these target ids only (FR-Spec, methods/eagle/fr_spec.py);
    None: the whole vocabulary (EAGLE-3: its own draft vocabulary)."""

    def __init__(self, target, head: EagleHead, tree: TreeSettings, name: str = "eagle",
                 vocab: Tensor | None = None) -> None:
        self.name = name
        self.head = head.eval().requires_grad_(False)
        self.tree = tree
        self.taps = tuple(head.config.taps)
        self.dtype = head.q_proj.weight.dtype
        self.embed = target.engine.embed
        # EAGLE-1/2 project with the target's lm_head (its `vocab` rows); a copy in the head's
        # dtype (bf16 by default) halves the bytes each draft level reads.
        lm_head = target.engine.lm_head
        self.vocab = None if vocab is None else vocab.to(lm_head.device)
        self.lm_head = (lm_head if self.vocab is None else lm_head[self.vocab]).to(self.dtype)
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
        if self.vocab is not None:
            return logits.log_softmax(-1), self.vocab
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
    def _run_nodes(self, tree: _Tree, nodes: Tensor) -> Tensor:
        """Run `nodes` (all of one depth) through the head; returns their log-probs."""
        n = len(nodes)
        embeds = F.embedding(tree.tokens[nodes], self.embed).to(self.dtype)
        parent_rows = tree.parents[nodes] + 1  # row 0 of outputs / sees: the root
        parent_out = tree.outputs[parent_rows]
        with torch.inference_mode():
            hidden = parent_out if self.head.config.kind == "eagle3" else self.head.fuse([parent_out], embeds)
            start = self.cache.length
            own = torch.arange(tree.rows, tree.rows + n, device=nodes.device)
            sees = tree.sees[parent_rows]
            sees[torch.arange(n, device=nodes.device), own] = True
            tree.sees[nodes + 1] = sees
            visible = torch.ones(n, start + n, dtype=torch.bool, device=hidden.device)
            visible[:, self.context_rows:] = sees[:, :start + n - self.context_rows]
            positions = self.context_rows - 1 + tree.depths[nodes]
            out = self._step_visible(hidden, embeds, positions, visible)
        tree.rows += n
        tree.outputs[nodes + 1] = out
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

    def _new_tree(self, capacity: int, tree_rows: int, root_out: Tensor) -> _Tree:
        tree = _Tree(capacity, tree_rows, root_out.shape[-1], root_out.device, root_out.dtype)
        tree.outputs[0] = root_out
        return tree

    def _dynamic(self, root_log_probs: Tensor, vocab: Tensor, root_out: Tensor) -> Draft:
        k, depth = self.tree.top_k, self.tree.depth
        tree = self._new_tree(k + (depth - 1) * k * k, (depth - 1) * k, root_out)
        values, ids = root_log_probs.topk(k)
        frontier = tree.add(vocab[ids], torch.full((k,), -1, device=ids.device), values.double())
        for _ in range(depth - 1):
            values, ids = self._run_nodes(tree, frontier).topk(k, dim=-1)
            scores = (tree.scores[frontier][:, None] + values.double()).reshape(-1)
            candidates = tree.add(vocab[ids.reshape(-1)], frontier.repeat_interleave(k), scores)
            frontier = candidates[torch.sort(-scores, stable=True).indices[:k]]
        best = torch.sort(-tree.scores[:tree.size], stable=True).indices[: self.tree.total_token - 1]
        return tree.to_draft(best)

    def _static(self, root_log_probs: Tensor, vocab: Tensor, root_out: Tensor) -> Draft:
        """The fixed rank paths, level by level: a level's parents run through the head
        together and each path takes its parent's rank-r child."""
        paths = self.tree.paths
        device = root_out.device
        widest = [1 + max(p[-1] for p in paths if len(p) == d) for d in range(1, max(map(len, paths)) + 1)]
        tree = self._new_tree(len(paths), len(paths), root_out)
        node_of: dict[tuple[int, ...], int] = {}
        ranked = root_log_probs.topk(widest[0]).indices
        level = sorted(p for p in paths if len(p) == 1)
        tree.add(vocab[ranked[[p[0] for p in level]]], torch.full((len(level),), -1, device=device),
                         torch.zeros(len(level), dtype=torch.float64, device=device))
        node_of.update(zip(level, range(len(level))))
        for depth in range(1, len(widest)):
            parents = sorted({p[:-1] for p in paths if len(p) == depth + 1 and p[:-1] in node_of})
            if not parents:
                break
            row_of = {parent: row for row, parent in enumerate(parents)}
            ranked = self._run_nodes(tree, torch.tensor([node_of[p] for p in parents], device=device)).topk(
                widest[depth], dim=-1).indices
            level = sorted(p for p in paths if len(p) == depth + 1 and p[:-1] in node_of)
            rows = torch.tensor([row_of[p[:-1]] for p in level], device=device)
            ranks = torch.tensor([p[-1] for p in level], device=device)
            first = tree.size
            tree.add(vocab[ranked[rows, ranks]], torch.tensor([node_of[p[:-1]] for p in level], device=device),
                     torch.zeros(len(level), dtype=torch.float64, device=device))
            node_of.update(zip(level, range(first, first + len(level))))
        return tree.to_draft(torch.tensor(sorted(node_of.values()), device=device))
