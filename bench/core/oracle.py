"""Oracle acceptance: what a method's drafting plus verification cost at a chosen acceptance.

The method drafts as usual (its draft pass, tree shape and size are real), then each
draft token is replaced: a node whose parent is right (or the root) gets the AR baseline's
own next token with probability `accept` (siblings tried deepest subtree first, at most one
right child per parent), and otherwise a token the baseline would not emit there. The target still verifies every
round, so the output stays the target's own; what changes is only how much is accepted.
Runs at a few `accept` values draw a method's "speedup at tau" curve, apart from how good
its drafter is, on any device and any target (random-weight GPU targets included).
Greedy only: the baseline's next tokens are then the target's argmax continuation.
"""

from __future__ import annotations

import random
import zlib

import torch

from bench.core.decode import DecodeConfig, DecodeState, Drafter, LoopDecoder, TurnResult, decode
from bench.core.draft import Draft
from bench.core.errors import BenchError


class OracleDrafter(Drafter):
    """`inner`'s drafts with their tokens set by the oracle (see the module docstring)."""

    def __init__(self, inner: Drafter, accept: float, vocab_size: int) -> None:
        self.inner, self.accept, self.vocab_size = inner, accept, vocab_size
        self.name, self.lossless, self.taps = inner.name, inner.lossless, inner.taps
        self.reference: list[int] = []  # the AR baseline's reply to this turn's prompt
        self.rng = random.Random(0)

    def begin(self, state, prefill) -> None:
        self.inner.begin(state, prefill)

    def propose(self, state: DecodeState) -> Draft:
        draft = self.inner.propose(state)
        if not draft.tokens:
            return draft
        parents, tokens = draft.parents, list(draft.tokens)
        children: dict[int, list[int]] = {}
        height = [1] * len(tokens)  # longest path down from each node, itself included
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        for i in reversed(range(len(tokens))):
            if parents[i] >= 0:
                height[parents[i]] = max(height[parents[i]], height[i] + 1)
        depth = dict.fromkeys(range(-1, len(tokens)), 0)
        at_root = len(state.generated) - 1  # the root is generated[at_root]; its children predict the next
        right = [-1]  # right nodes whose children are still to be decided
        while right:
            parent = right.pop()
            at = at_root + depth[parent] + 1
            want = self.reference[at] if at < len(self.reference) else None
            chosen = False
            # Siblings are alternatives: each, deepest subtree first, is the right one with
            # probability `accept` until one is, so accept=1 takes a deepest path.
            for child in sorted(children.get(parent, []), key=lambda c: -height[c]):
                depth[child] = depth[parent] + 1
                if want is None:
                    continue
                if not chosen and self.rng.random() < self.accept:
                    tokens[child], chosen = want, True
                    right.append(child)
                elif tokens[child] == want:
                    tokens[child] = (want + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        draft.tokens = tokens
        return draft

    def verify(self, draft, logits, sampling, generator):
        return self.inner.verify(draft, logits, sampling, generator)

    def learn(self, state, draft, verdict, out, rows) -> None:
        self.inner.learn(state, draft, verdict, out, rows)


class OracleDecoder(LoopDecoder):
    """A loop method under oracle acceptance. Each turn first decodes the AR baseline's
    reply (untimed, kept per prompt), then the method's timed turn against it."""

    def __init__(self, decoder: LoopDecoder, accept: float, seed: int = 0) -> None:
        vocab = decoder.target.engine.vocab_size
        super().__init__(decoder.target, OracleDrafter(decoder.drafter, accept, vocab), decoder.info)
        self.seed = seed
        self.references: dict[tuple, list[int]] = {}

    def run_turn(self, prompt: list[int], config: DecodeConfig,
                 generator: torch.Generator | None = None) -> TurnResult:
        if config.sampling.temperature > 0:
            raise BenchError("oracle_accept is defined for greedy decoding (temperature 0)")
        key = (tuple(prompt), config.max_new_tokens, config.eos_token_ids, config.stop_strings)
        if key not in self.references:
            self.references[key] = decode(self.target.engine, Drafter(), prompt, config,
                                          tokenizer=self.target.tokenizer).tokens
        self.drafter.reference = self.references[key]
        self.drafter.rng = random.Random(zlib.crc32(repr((self.seed, prompt)).encode()))  # same draws per turn
        return super().run_turn(prompt, config, generator)
