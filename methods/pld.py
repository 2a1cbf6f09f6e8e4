"""Prompt lookup decoding (Saxena 2023): draft by copying what followed the last n-gram
earlier in the prompt or the output. No model. Defaults as in the original: the longest
of the last 3..1 tokens, first match from the left, up to 10 following tokens."""

from __future__ import annotations

import torch

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft


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


def build(target, options: dict) -> LoopDecoder:
    return LoopDecoder(target, PromptLookupDrafter(int(options.get("max_ngram", 3)),
                                                   int(options.get("num_pred_tokens", 10))))
