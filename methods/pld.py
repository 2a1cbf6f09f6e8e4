"""Prompt lookup decoding (Saxena 2023): draft by copying what followed the last n-gram
earlier in the prompt or the output. No model. Defaults as in the original: the longest
of the last 3..1 tokens, first match from the left, up to 10 following tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft
from bench.core.options import DraftOptions, option, parse_options

METHOD = "pld"


@dataclass(frozen=True)
class Options(DraftOptions):
    """max_ngram: longest suffix matched; num_pred_tokens: tokens copied after the match.
    --budget K: num_pred_tokens = K (a chain of at most K drafts)."""

    max_ngram: int = option(3, min=1)
    num_pred_tokens: int = option(10, min=1)

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"num_pred_tokens": budget}

    def draft_budget(self) -> int | None:
        return self.num_pred_tokens


def lookup(tokens: list[int], max_ngram: int = 3, num_pred_tokens: int = 10) -> list[int]:
    """Tokens that followed the first earlier occurrence of the longest matching suffix."""
    sequence = torch.tensor(tokens)
    length = len(tokens)
    for size in range(min(max_ngram, length - 1), 0, -1):
        suffix = sequence[-size:]
        windows = sequence[: length - 1].unfold(0, size, 1)  # excludes the suffix itself
        hits = (windows == suffix).all(dim=1).nonzero().flatten()
        for start in hits.tolist():
            follow = start + size
            if follow < length:
                return tokens[follow: follow + num_pred_tokens]
    return []


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, num_pred_tokens: int = 10) -> None:
        self.max_ngram = max_ngram
        self.num_pred_tokens = num_pred_tokens

    def propose(self, state: DecodeState) -> Draft:
        return Draft.chain(lookup(state.tokens, self.max_ngram, self.num_pred_tokens))


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    return LoopDecoder(target, PromptLookupDrafter(opts.max_ngram, opts.num_pred_tokens))
