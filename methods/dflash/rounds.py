"""Greedy decode rounds of a block drafter replayed from one target pass over a finished
sequence: what `bench train` reports as the τ a DFlash or DSpark drafter predicts, and what
`bench rounds --method dflash` sets beside the grid's recorded rounds (its hook: methods/dflash/replay.py).

A greedy round verifying a whole block is a function of the committed tokens alone: the block
[root, MASK ...] sees the target's features strictly before the root, and every draft the
loop accepts is the target's own token (so DSpark's Markov head reads the data's previous
token, as teacher forcing does). The replay therefore gives the loop's rounds up to numerics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bench.training import simulated_rounds


@torch.no_grad()
def chain_drafts(model, embed: Tensor, lm_head: Tensor, tokens: Tensor, taps: list[Tensor], roots: list[int],
                 drafts: list[int]) -> list[list[int]]:
    """The greedy chain (target ids) the block at each root drafts, `drafts[i]` long, from the
    tapped target states [n, d] of `tokens`. Full blocks run together in training's layout;
    a shorter one (the loop's last rounds, as z-lab's) alone, since a block's slots attend to
    each other and fewer mask slots draft otherwise."""
    c, device = model.config, embed.device
    first, n, dtype = c.first_draft_slot, len(tokens), model.fc.weight.dtype
    tokens = tokens.to(device)
    context = model.context([t[None].to(device=device, dtype=dtype) for t in taps])
    context_kv = model.context_kv(context, torch.arange(n, device=device)[None])
    out: list[list[int]] = [[] for _ in roots]
    full = [i for i, d in enumerate(drafts) if d == c.drafts_per_block]
    if full:
        root_ids = torch.tensor([roots[i] for i in full], device=device)
        slots = torch.arange(c.block_size, device=device)
        previous = context[:, root_ids - 1] if c.anchor_context else None
        x = model.block_inputs(tokens[root_ids][None], embed, c.block_size, previous).flatten(1, 2)
        positions = (root_ids[:, None] + slots).flatten()[None]
        visible = (torch.arange(n, device=device)[None, :] < root_ids[:, None])[:, None, :].expand(-1, c.block_size, -1)
        hidden = model.forward_block(x, positions, context_kv, context_visible=visible.reshape(1, -1, n))
        rows = _greedy(model, hidden.view(len(full), c.block_size, -1)[:, first:], lm_head, tokens, root_ids)
        for i, row in zip(full, rows):
            out[i] = row
    for i, (root, count) in enumerate(zip(roots, drafts)):
        if count != c.drafts_per_block:
            slots = count + first
            previous = context[:, root - 1] if c.anchor_context else None
            x = model.block_inputs(tokens[root: root + 1], embed, slots, previous)
            views = [(k[..., :root, :], v[..., :root, :]) for k, v in context_kv]
            hidden = model.forward_block(x, torch.arange(root, root + slots, device=device)[None], views)[:, first:]
            out[i] = _greedy(model, hidden, lm_head, tokens, torch.tensor([root], device=device))[0]
    return out


# Rows of fp32 logits over the draft vocabulary at a time: all of a held-out conversation's ~500
# roots x 15 drafts x 49,152 at once was ~1.5 GB, a few times over, beside a trainer.
ARGMAX_CHUNK_ROWS = 512


def draft_argmax(model, hidden: Tensor, previous: Tensor, lm_head: Tensor) -> Tensor:
    """Each slot's greedy draft, an index into the draft vocabulary, from its hidden state
    [..., d] (DSpark's Markov bias from `previous` [...], the token before it)."""
    rows, before = hidden.reshape(-1, hidden.shape[-1]), previous.reshape(-1)
    drafts = torch.empty(len(rows), dtype=torch.long, device=hidden.device)
    for at in range(0, len(rows), ARGMAX_CHUNK_ROWS):
        logits = model.logits(rows[at:at + ARGMAX_CHUNK_ROWS], lm_head)
        if model.config.markov_rank:
            logits = logits + model.markov_bias(model.markov_state(before[at:at + ARGMAX_CHUNK_ROWS])).float()
        drafts[at:at + ARGMAX_CHUNK_ROWS] = logits.argmax(-1)
    return drafts.view(hidden.shape[:-1])


def _greedy(model, hidden: Tensor, lm_head: Tensor, tokens: Tensor, roots: Tensor) -> list[list[int]]:
    """Each block's argmax drafts [blocks, drafts] as target ids; DSpark's Markov bias from the
    token before each draft (the data's: drafts after a miss are never verified)."""
    before = (roots[:, None] + torch.arange(hidden.shape[1], device=roots.device)).clamp(max=len(tokens) - 1)
    return model.draft_to_target[draft_argmax(model, hidden, tokens[before], lm_head)].tolist()


def sequence_rounds(model, embed: Tensor, lm_head: Tensor, tokens: Tensor, taps: list[Tensor], reply: Tensor,
                    roots: Tensor, left: int | None = None) -> tuple[int, int, int]:
    """simulated_rounds over one sequence: rounds may start at `roots` (bool per position), a
    draft counts where it is the sequence's token and that token is a reply token (`reply`).
    `left`: the loop's max_new_tokens, which shortens its last blocks (the reply starts at the
    first root)."""
    size = model.config.drafts_per_block
    where = roots.nonzero().flatten().tolist()
    if not where:
        return 0, 0, 0
    counts = [size if left is None else max(1, min(size, left - (s - where[0] + 1))) for s in where]
    hit = drafted_hits(tokens, reply, where, chain_drafts(model, embed, lm_head, tokens, taps, where, counts))
    return simulated_rounds(hit, roots.tolist())


def drafted_hits(tokens: Tensor, reply: Tensor, roots: list[int], drafted: list[list[int]]) -> list[list[bool]]:
    """hit[k][s]: the k-th draft of the block at root s is the sequence's reply token there."""
    n, size = len(tokens), max(map(len, drafted), default=0)
    hit = [[False] * n for _ in range(size)]
    tokens, reply = tokens.tolist(), reply.tolist()
    for s, row in zip(roots, drafted):
        for k, token in enumerate(row):
            at = s + 1 + k
            hit[k][s] = at < n and reply[at] and token == tokens[at]
    return hit


def reply_rows(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """From a feature cache's loss mask (row r: token r+1 is a reply token): which tokens are
    reply tokens, and where a round may start (a reply token followed by another)."""
    from bench.training import round_starts

    reply = torch.cat([torch.zeros(1, dtype=torch.bool), loss_mask[:-1].bool()])
    return reply, round_starts(reply)


def heldout_rounds(model, embed: Tensor, lm_head: Tensor, tensors: dict[str, Tensor],
                   spans: list[tuple[int, int]], keep: int | None = None) -> dict:
    """Rounds replayed over held-out conversations of a feature cache (`spans` of `tensors`),
    whole blocks verified: τ, the first draft's acceptance, and the first draft's agreement
    over every root; with `keep`, the same with each reply cut to its first `keep` tokens, as
    the grid's turns are (under `first_<keep>`)."""
    from bench.training import by_cut, first_reply_tokens, replay_cuts, rounds_prediction

    cuts = replay_cuts(keep)
    totals = {cut: [0, 0, 0, 0, 0] for cut in cuts}  # rounds, accepted, first accepted, first-draft hits, roots
    for a, b in spans:
        tokens, mask = tensors["tokens"][a:b].long(), tensors["loss_mask"][a:b].bool()
        taps = [tensors[f"h{t}"][a:b] for t in model.config.taps]
        reply, roots = reply_rows(mask)
        where = roots.nonzero().flatten().tolist()
        if not where:
            continue
        drafted = chain_drafts(model, embed, lm_head, tokens, taps, where, [model.config.drafts_per_block] * len(where))
        for cut in cuts:
            cut_reply, cut_roots = (reply, roots) if cut is None else reply_rows(first_reply_tokens(mask, 0, cut))
            hit = drafted_hits(tokens, cut_reply, where, drafted)
            starts = cut_roots.nonzero().flatten().tolist()
            counts = simulated_rounds(hit, cut_roots.tolist()) + (sum(hit[0][s] for s in starts), len(starts))
            totals[cut] = [x + y for x, y in zip(totals[cut], counts)]
    return by_cut({cut: dict(rounds_prediction(rounds, accepted, first),
                             first_draft_top1=round(hits / max(1, count), 4), roots=count)
                   for cut, (rounds, accepted, first, hits, count) in totals.items()})

