"""Lookahead decoding (Fu et al., 2402.02057): Jacobi iteration feeds an n-gram pool; pooled
n-grams that start with the last committed token are verified in the same target pass.

One target pass carries two branches beside the root:
- the lookahead branch, a window of W columns x (N-1) levels of past Jacobi guesses. Token
  (level l, column i) sits at position root+i+l and sees the root, level 0 up to column i,
  and its own column in levels 1..l: each column is the trajectory of one Jacobi guess.
  The pass's argmax at the last level is the next level; the column plus that output is an
  N-gram for the pool (keyed by its first token, at most G per key, least recent dropped).
- the verification branch: up to G pooled (N-1)-grams continuing the root, merged into a
  token trie and verified as a deterministic tree (lossless at any temperature).
The window advances one level per round whatever was accepted (the original's default).
Defaults N=5, W=7, G=7 as in the paper's README and Spec-Bench.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

import torch

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft
from bench.core.engine import ForwardOutput
from bench.core.options import DraftOptions, option, parse_options
from bench.core.verify import Verdict

METHOD = "lookahead"


@dataclass(frozen=True)
class Options(DraftOptions):
    """ngram N, window W (Jacobi columns), guesses G (pooled n-grams verified per round), seed
    (level 0's random prompt tokens).

    --budget K: the verification branch holds at most G (N-1)-grams, i.e. G*(N-1) draft
    nodes (fewer where they share prefixes), so N stays 5 and G = W = the nearest whole
    K/4 (halves round up; W = G as the paper's defaults W = G = 7, i.e. K = 28); below 4,
    N = K+1 and G = W = 1."""

    ngram: int = option(5, min=2)
    window: int = option(7, min=1)
    guesses: int = option(7, min=0)
    seed: int = 0

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        if budget < 4:
            return {"ngram": budget + 1, "window": 1, "guesses": 1}
        guesses = (budget + 2) // 4
        return {"ngram": 5, "window": guesses, "guesses": guesses}

    def draft_budget(self) -> int | None:
        return self.guesses * (self.ngram - 1)


class NgramPool:
    """first token -> up to `capacity` continuations, least recently added dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        bucket = self.entries.setdefault(ngram[0], OrderedDict())
        bucket.pop(ngram[1:], None)
        bucket[ngram[1:]] = None
        if len(bucket) > self.capacity:
            bucket.popitem(last=False)

    def continuations(self, token: int) -> list[tuple[int, ...]]:
        return list(self.entries.get(token, {}))


def trie(continuations: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Merge candidate continuations into one token tree (tokens, parents)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, tuple[int, ...]], int] = {}
    for continuation in continuations:
        parent = -1
        for token in continuation:
            key = (parent, (token,))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[key]
    return tokens, parents


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, ngram: int = 5, window: int = 7, guesses: int = 7, seed: int = 0) -> None:
        if ngram < 2 or window < 1 or guesses < 0:
            raise ValueError("lookahead needs N >= 2, W >= 1, G >= 0")
        self.ngram, self.window, self.guesses = ngram, window, guesses
        self.seed = seed

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.pool = NgramPool(self.guesses)
        rng = random.Random(self.seed)
        prompt = state.tokens[: state.prompt_len]
        # Level 0 starts as random prompt tokens (as the original); later levels fill up
        # one per round until the window holds N-1 levels.
        self.levels = [[rng.choice(prompt) for _ in range(self.window)]]

    def _window(self) -> tuple[list[int], list[int], list[list[int]]]:
        """Flattened lookahead tokens, positions (relative to the root) and, per token,
        the window indices it may see (besides the root and itself)."""
        tokens, positions, sees = [], [], []
        for level, row in enumerate(self.levels):
            for column, token in enumerate(row):
                tokens.append(token)
                positions.append(column + 1 + level)
                visible = list(range(column))  # level 0, earlier columns
                visible += [lv * self.window + column for lv in range(level)]  # own column below
                sees.append(visible)
        return tokens, positions, sees

    def propose(self, state: DecodeState) -> Draft:
        candidates = self.pool.continuations(state.root)[: self.guesses]
        draft_tokens, parents = trie(candidates)
        draft = Draft(tokens=draft_tokens, parents=parents)
        tokens, positions, sees = self._window()
        size = len(draft_tokens) + 1
        mask = torch.zeros(len(tokens), size + len(tokens), dtype=torch.bool)
        mask[:, 0] = True  # every window token sees the root
        for row, visible in enumerate(sees):
            mask[row, size + row] = True
            for col in visible:
                mask[row, size + col] = True
        draft.extra_tokens, draft.extra_positions, draft.extra_mask = tokens, positions, mask
        return draft

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        first = len(draft) + 1
        guesses = out.logits[first:].argmax(-1).tolist()
        last_level = guesses[-self.window:]
        if len(self.levels) == self.ngram - 1:
            for column in range(self.window):
                self.pool.add(tuple(row[column] for row in self.levels) + (last_level[column],))
            self.levels = self.levels[1:]
        self.levels.append(last_level)


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    return LoopDecoder(target, LookaheadDrafter(ngram=opts.ngram, window=opts.window, guesses=opts.guesses,
                                                seed=opts.seed))
