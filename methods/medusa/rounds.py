"""Greedy Medusa rounds replayed from one teacher-forced pass: what a tree of rank paths accepts.

Head i at row t reads the target's final state h_t and ranks its candidates for token t+2+i. In
a greedy round starting at row t (token t+1, the last round's bonus, known) the target accepts
the longest tree path whose every node is the target's own token; on the target's greedy reply
that is the data's token, so the path accepted is the one whose ranks are the data tokens' ranks
in the heads' top-k, cut where the tree has no such node. The next round starts after the bonus
(bench.training.simulated_rounds). Replayed on a grid turn this gives the rounds the loop
recorded; on held-out replies, the τ a drafter gives its tree before any decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.training import (
    by_cut,
    first_reply_tokens,
    replay_cuts,
    round_starts,
    rounds_prediction,
    simulated_rounds,
)
from methods.medusa.tree import TOPK


def data_ranks(heads, lm_head: Tensor, hidden: Tensor, tokens: Tensor, depth: int,
               rows: Tensor | None = None) -> Tensor:
    """[depth, n]: the rank of token t+2+i among head i's top-TOPK at row t (-1: not there, past
    the sequence, or t not in `rows`, default every row). hidden [n, d] are the target's final states."""
    n = len(tokens)
    rows = torch.arange(n) if rows is None else rows
    ranks = torch.full((depth, n), -1, dtype=torch.long)
    for i in range(depth):
        at = rows[rows < n - 2 - i]
        if not len(at):
            break
        states = hidden[at].to(lm_head.device, torch.float32)
        top = F.linear(heads.blocks[i](states), lm_head).topk(TOPK, dim=-1).indices.cpu()
        found = top == tokens[at + 2 + i, None]
        ranks[i, at] = torch.where(found.any(-1), found.float().argmax(-1), -1)
    return ranks


def tree_hits(ranks: Tensor, mask: Tensor, paths: list[tuple[int, ...]]) -> list[list[bool]]:
    """hits[k][t]: a round at row t accepts at least k+1 drafts, i.e. the tree holds the path of
    the data tokens' ranks at heads 0..k, and tokens t+2..t+2+k are reply tokens (mask[r]: token
    r+1 is a reply token)."""
    known = {tuple(p) for p in paths}
    depth = max((len(p) for p in paths), default=0)
    n = ranks.shape[1]
    reply = mask.bool().tolist() + [False] * (depth + 1)
    rank_rows, hits = ranks[:depth].T.tolist(), [[False] * n for _ in range(depth)]
    for t in range(n):
        for k in range(depth):
            if not reply[t + 1 + k] or tuple(rank_rows[t][: k + 1]) not in known:
                break
            hits[k][t] = True
    return hits


def sequence_rounds(heads, lm_head: Tensor, hidden: Tensor, tokens: Tensor, mask: Tensor,
                    paths: list[tuple[int, ...]], starts: Tensor | None = None) -> tuple[int, int, int]:
    """(rounds, accepted, first accepted) of the tree `paths` over one sequence; rounds start at
    rows where `starts` holds (default: where mask does)."""
    depth, starts = max(len(p) for p in paths), mask if starts is None else starts
    ranks = data_ranks(heads, lm_head, hidden, tokens, depth, starts.nonzero().flatten())
    return simulated_rounds(tree_hits(ranks, mask, paths), starts.tolist())


def heldout_rounds(heads, lm_head: Tensor, features: dict[str, Tensor], spans: list[tuple[int, int]],
                   paths: list[tuple[int, ...]], keep: int | None = None) -> dict:
    """Rounds of the tree over held-out conversations (`spans` of a feature cache: tokens,
    loss_mask, h = the target's final states) and head 0's top-1 agreement there; with `keep`,
    the same with each reply cut to its first `keep` tokens, as the grid's turns are (under
    `first_<keep>`)."""
    depth = max(len(p) for p in paths)
    cuts = replay_cuts(keep)
    totals = {cut: [0, 0, 0, 0, 0] for cut in cuts}  # rounds, accepted, first accepted, head-0 hits, pairs
    with torch.no_grad():
        for a, b in spans:
            tokens, full = features["tokens"][a:b].long(), features["loss_mask"][a:b].bool()
            ranks = data_ranks(heads, lm_head, features["h"][a:b], tokens, depth, full.nonzero().flatten())
            for cut in cuts:
                mask = full if cut is None else first_reply_tokens(full, 0, cut)
                pairs = round_starts(mask)  # token t+1 and t+2 both reply tokens: a round may start at t
                counts = simulated_rounds(tree_hits(ranks, mask, paths), pairs.tolist())
                head0 = int(((ranks[0] == 0) & pairs).sum())
                totals[cut] = [x + y for x, y in zip(totals[cut], counts + (head0, int(pairs.sum())))]
    return by_cut({cut: dict(rounds_prediction(rounds, accepted, first), head0_top1=round(hits / max(1, count), 4),
                             rows=count, tree_size=len(paths))
                   for cut, (rounds, accepted, first, hits, count) in totals.items()})


def recorded_tree(header: dict, accuracy, stored_tree) -> list[tuple[int, ...]]:
    """The tree a record's decoder built: sized for its device or given by a count (the
    best-first cut of the measured accuracies), or the drafter's stored tree."""
    from bench.core.errors import BenchError
    from methods.medusa.tree import build_tree

    size, source = header["tree_size"], header.get("tree_source", "")
    if source == "manifest":
        return [tuple(p) for p in stored_tree]
    if not accuracy:
        raise BenchError(f"the drafter has no measured accuracies to rebuild a '{source}' tree from")
    return build_tree(accuracy, max(64, size))[:size]


class Replay:
    """`bench rounds --method medusa`: greedy rounds of the decoder's tree simulated from
    teacher-forced drafts on recorded grid turns and on the pool's last conversations."""

    what = ("Medusa: greedy rounds of the decoder's tree simulated from teacher-forced drafts on held-out replies "
            "and on the grid's turns, beside the rounds the loop recorded for those turns")

    def __init__(self, target) -> None:
        from bench.core.drafters import find_drafter, weights_sha1
        from methods.medusa.model import load_drafter

        self.target = target
        folder = find_drafter(target.name, "medusa", None)
        self.heads, self.accuracy, self.stored_tree, info = load_drafter(target, folder)
        self.heads.eval()
        self.lm_head = target.engine.lm_head.float()
        self.tap = target.engine.num_layers
        self.info = {"drafter": str(folder), "weights_sha1": weights_sha1(folder),
                     "trained_steps": info.get("trained_steps")}
        self.paths: list[tuple[int, ...]] = [(0,)]

    def check(self, settings: dict) -> str | None:
        self.paths = recorded_tree(settings["drafter"], self.accuracy, self.stored_tree)
        ran = settings["drafter"].get("weights_sha1")
        return None if ran in (None, self.info["weights_sha1"]) else f"weights {ran}"

    def turn(self, settings: dict, prompt: list[int], record: dict) -> tuple[int, int, int]:
        tokens = torch.tensor(prompt + record["tokens"])
        hidden = self.target.engine.prefill(tokens, taps=(self.tap,), logits_rows="none").hidden[self.tap]
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[len(prompt) - 1: len(tokens) - 1] = True  # the prefill's row drafts the second reply token
        return sequence_rounds(self.heads, self.lm_head, hidden, tokens, mask, self.paths)

    def heldout(self, conversations: int, reply_tokens: int) -> dict:
        from bench.training.features import FeatureData, ensure_features

        store = ensure_features(self.target, (self.tap,), FeatureData(max_tokens=5_000_000, self_distill=True),
                                progress=False)
        data = store.load((self.tap,))
        features = {"tokens": data["tokens"], "loss_mask": data["loss_mask"], "h": data[f"h{self.tap}"]}
        offsets = data["offsets"].tolist()[-1 - conversations:]
        spans = list(zip(offsets[:-1], offsets[1:]))
        trees = {"one_node": [(0,)], "grid": self.paths} if len(self.paths) > 1 else {"one_node": [(0,)]}
        found = {tree: heldout_rounds(self.heads, self.lm_head, features, spans, paths, keep=reply_tokens)
                 for tree, paths in trees.items()}
        return dict(found.get("grid", found["one_node"]), trees=found, conversations=len(spans),
                    features=str(store.folder))
