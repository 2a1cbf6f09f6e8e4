"""SpS rounds replayed from one teacher-forced pass of the draft.

SpS drafts a greedy chain of `gamma` tokens with its own small LM. In a greedy round every
accepted draft is the target's token, so the draft reads the teacher-forced prefix: a round
whose last known token is t+1 drafts token t+2+k from the draft's logits at row t+1+k, and the
rounds of a turn replay from one teacher-forced pass of the draft
(bench.training.next_token_rounds). On the grid's own turns the replay must give the τ the
loop recorded; on the draft's held-out conversations (whole replies, and their first tokens as
the grid's turns are) it says how much of the gap to the held-out prediction is where rounds
start and how much is a reply's opening.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bench.training import first_reply_tokens, next_token_rounds, rounds_prediction


def draft_right(draft_argmax: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    """right[r]: the draft's top-1 after token r is token r+1, a reply token (mask[r] whether
    token r+1 is a reply token)."""
    right = torch.zeros(len(tokens), dtype=torch.bool)
    right[:-1] = (draft_argmax[:-1] == tokens[1:]) & mask[:-1]
    return right


def sequence_rounds(draft, tokens: Tensor, mask: Tensor, gamma: int,
                    starts: Tensor | None = None) -> tuple[tuple[int, int, int], int, int]:
    """(rounds, accepted, first accepted) over one sequence (bench.training.next_token_rounds),
    the rows whose next token is a reply token, and at how many the draft's top-1 is right."""
    right = draft_right(draft.prefill(tokens, logits_rows="all").logits.argmax(-1), tokens, mask)
    counts = next_token_rounds(right.tolist(), mask.tolist(), gamma, None if starts is None else starts.tolist())
    return counts, int(mask.sum()), int(right.sum())


def turn_rows(prompt_len: int, length: int, stop_reason: str | None) -> tuple[Tensor, Tensor]:
    """(mask, starts) of a recorded turn. The prefill gives the first reply token; the loop
    drafts at most up to the token before max_new_tokens (the last is always a round's bonus),
    so a turn cut by its length neither drafts its last token nor starts a round after it. A
    turn that ended at EOS may have accepted drafts past its EOS, which its record cuts off:
    there the replay can undercount the last round."""
    end = length - 1 if stop_reason == "length" else length
    mask, starts = torch.zeros(length, dtype=torch.bool), torch.zeros(length, dtype=torch.bool)
    mask[prompt_len - 1: end - 1] = True
    starts[prompt_len - 1: length - 2] = True
    return mask, starts


def heldout_rounds(draft, data: dict, conversations: int, gamma: int, keep: int | None) -> dict:
    """Rounds over the draft's held-out conversations (the first `conversations` of the cache),
    each reply cut to its first `keep` tokens where given."""
    offsets = data["offsets"].tolist()[: conversations + 1]
    mask = data["loss_mask"][: offsets[-1]].bool()
    if keep is not None:
        mask = first_reply_tokens(mask, 0, keep)
    total, rows, right = [0, 0, 0], 0, 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        counts, n, r = sequence_rounds(draft, data["tokens"][a:b].long(), mask[a:b], gamma)
        total = [x + y for x, y in zip(total, counts)]
        rows, right = rows + n, right + r
    return dict(rounds_prediction(*total), rows=rows, top1_position0=round(right / max(1, rows), 4))


class Replay:
    """`bench rounds --method sps`: the shipped draft's gamma-token chain replayed on recorded
    grid turns and on its held-out conversations."""

    what = ("SpS: greedy rounds of the draft's gamma-token chain simulated from teacher-forced drafts on the "
            "draft's held-out conversations and on the grid's turns, beside the rounds the loop recorded")

    def __init__(self, target) -> None:
        from bench.core.drafters import find_drafter, read_manifest
        from methods.sps import Options, load_draft_engine

        self.target = target
        self.folder = find_drafter(target.name, "sps", None)
        self.manifest = read_manifest(self.folder)
        self.draft, info = load_draft_engine(target, self.folder)
        self.gamma = Options().gamma  # the default run's, until a record file says which it ran
        self.info = {"drafter": str(self.folder), "weights_sha1": info["weights_sha1"]}

    def check(self, settings: dict) -> str | None:
        from bench.core.target import parse_dtype
        from methods.sps import load_draft_engine

        header = settings["drafter"]
        self.gamma = header["gamma"]
        self.draft, info = load_draft_engine(self.target, self.folder, parse_dtype(header["draft_dtype"]))
        return None if info["weights_sha1"] == header["weights_sha1"] else f"weights {header['weights_sha1']}"

    def turn(self, settings: dict, prompt: list[int], record: dict) -> tuple[int, int, int]:
        tokens = torch.tensor(prompt + record["tokens"])
        mask, starts = turn_rows(len(prompt), len(tokens), record.get("stop_reason"))
        return sequence_rounds(self.draft, tokens, mask, self.gamma, starts)[0]

    def heldout(self, conversations: int, reply_tokens: int) -> dict:
        from bench.training.draft_lm import DraftLMSettings
        from bench.training.features import FeatureData, ensure_features

        settings = DraftLMSettings(**self.manifest.get("draft_settings", {}))
        tap = self.target.engine.num_layers
        store = ensure_features(self.target, (tap,), FeatureData(max_tokens=settings.feature_tokens or 5_000_000,
                                                                 self_distill=True), progress=False)
        data = store.load((tap,))
        count = min(conversations, settings.heldout)  # the cache's first conversations are the held-out ones
        whole = heldout_rounds(self.draft, data, count, self.gamma, None)
        return dict(whole, **{f"first_{reply_tokens}": heldout_rounds(self.draft, data, count, self.gamma,
                                                                       reply_tokens)},
                    gamma=self.gamma, recorded_at_export=self.manifest.get("heldout"), conversations=count,
                    features=str(store.folder))
