"""Losslessness, statistically: verify() must emit tokens distributed exactly as the target.

A toy world with V = 8 tokens: the target's logits and the draft's distribution q are
fixed random functions of the context (the tokens emitted so far), and q is deliberately
different from p. Each trial decodes two tokens through the real verify(): propose a
draft at the current context, verify it, commit the accepted path plus the next token,
and repeat until two tokens exist. The empirical joint distribution of the first two
tokens, and the first token's marginal, are compared with the target's
p(a) * p(b | a) by a chi-square test.

False alarms: each test rejects at alpha = 1e-4; the file runs 2 tests per mode, so a
correct verifier fails somewhere with probability <= 2 * len(MODES) * 1e-4 ~ 2e-3 for a
random seed (Bonferroni). Seeds are fixed, so a given checkout passes or fails
deterministically (the correct code's smallest p-value here is ~0.06).

Power, checked by hand with one deliberate bug at a time (each gave p-values < 1e-13 in
the modes listed; the others stayed > 0.05): accepting with min(1, q/p) -> every chain
and MSS mode; residual p instead of norm(max(0, p - q)) -> every chain and MSS mode; MSS
without the r update -> every MSS mode; plain MSS on without-replacement drafts ->
mss-without*; one-hot residual keeping the drafted token -> chain-onehot; deterministic
tree drawing from the parent's row -> tree-topk* (joint only); bonus drawn from the last
draft row -> every chain mode (joint only). test_detector_has_power keeps one of them.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import bench.core.verify as verify_module
from bench.core.draft import Draft
from bench.core.sampling import SamplingConfig, probabilities
from bench.core.verify import WITHOUT_REPLACEMENT, verify

V = 8
TRIALS = 12_000
ALPHA = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny tensor ops: intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class World:
    """Target logits and draft distribution q for every context (tuple of emitted tokens)."""

    def __init__(self, cfg: SamplingConfig, draft_temperature: float = 1.0, seed: int = 0) -> None:
        self.cfg = cfg
        self.draft_temperature = draft_temperature
        self.seed = seed
        self._logits: dict[tuple, Tensor] = {}
        self._q: dict[tuple, tuple[Tensor, list[float]]] = {}

    def _noise(self, ctx: tuple, salt: int) -> Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, salt) + ctx) % 2**62)
        return torch.randn(V, generator=generator)

    def logits(self, ctx: tuple) -> Tensor:
        if ctx not in self._logits:
            self._logits[ctx] = 1.5 * self._noise(ctx, 1)
        return self._logits[ctx]

    def p(self, ctx: tuple) -> Tensor:
        return probabilities(self.logits(ctx), self.cfg).double()

    def q(self, ctx: tuple) -> Tensor:
        return self._q_entry(ctx)[0]

    def _q_entry(self, ctx: tuple) -> tuple[Tensor, list[float]]:
        if ctx not in self._q:  # correlated with the target, but clearly not equal to it
            logits = 0.5 * self.logits(ctx) + self._noise(ctx, 2)
            q = (logits / self.draft_temperature).softmax(-1)
            self._q[ctx] = (q, q.cumsum(0).tolist())
        return self._q[ctx]

    def draw(self, ctx: tuple, rng: random.Random, exclude: set[int] = frozenset()) -> int:
        """One token from q(ctx), or from q(ctx) without the excluded tokens."""
        q, cdf = self._q_entry(ctx)
        if not exclude:
            return min(bisect.bisect_right(cdf, rng.random() * cdf[-1]), V - 1)
        weights = [0.0 if t in exclude else w for t, w in enumerate(q.tolist())]
        return rng.choices(range(V), weights)[0]


# ---------------------------------------------------------------- draft builders


def chain_sampled(world: World, ctx: tuple, rng: random.Random) -> Draft:
    """Chain of 1 or 2 tokens drawn from q. The length is random but independent of the
    drawn tokens (allowed, §11b); length 1 puts the bonus token among the two observed."""
    tokens, rows = [], []
    for _ in range(rng.choice((1, 2))):
        here = ctx + tuple(tokens)
        rows.append(world.q(here))
        tokens.append(world.draw(here, rng))
    return Draft.chain(tokens, q=torch.stack(rows))


def chain_confidence_cut(world: World, ctx: tuple, rng: random.Random, peek: bool = False) -> Draft:
    """DSpark's scheduled chain: up to 3 tokens drawn from q; whether position j+1 is
    drafted depends on the tokens drawn so far (DSpark's confidence c_{j+1} reads x_j),
    never on x_{j+1} itself. With `peek`, the wrong rule: a drawn token is kept only if it
    is q's argmax, i.e. the cut looks at the very token it admits."""
    tokens, rows = [], []
    for _ in range(3):
        here = ctx + tuple(tokens)
        token = world.draw(here, rng)
        if peek and token != int(world.q(here).argmax()):
            break
        rows.append(world.q(here))
        tokens.append(token)
        if not peek and (token + len(here)) % 3 == 0:  # the "confidence" of the next slot is low
            break
    return Draft.chain(tokens, q=torch.stack(rows) if rows else None)


def chain_argmax(world: World, ctx: tuple, rng: random.Random) -> Draft:
    """Deterministic chain (q None) of the draft's argmax tokens, 1 or 2 long."""
    tokens: list[int] = []
    for _ in range(rng.choice((1, 2))):
        tokens.append(int(world.q(ctx + tuple(tokens)).argmax()))
    return Draft.chain(tokens)


def tree_topk(world: World, ctx: tuple, rng: random.Random, widths: tuple[int, int] = (3, 2)) -> Draft:
    """Deterministic children: the draft's top-3 at the root, top-2 under the first two
    of them (the third is a leaf at depth 1, so a bonus token can be observed)."""
    tokens, parents = [], []
    first = world.q(ctx).topk(widths[0]).indices.tolist()
    tokens += first
    parents += [-1] * len(first)
    for node, token in enumerate(first[:-1]):
        second = world.q(ctx + (token,)).topk(widths[1]).indices.tolist()
        tokens += second
        parents += [node] * len(second)
    return Draft(tokens, parents)


def tree_sampled(world: World, ctx: tuple, rng: random.Random, widths: tuple[int, int] = (3, 2),
                 without_replacement: bool = False) -> Draft:
    """SpecInfer multi-draft: each node's children drawn from q(node), i.i.d. or without
    replacement: 3 at the root, 2 under each of the first two (the third is a leaf)."""

    def siblings(here: tuple, count: int) -> list[int]:
        drawn: list[int] = []
        for _ in range(count):
            drawn.append(world.draw(here, rng, set(drawn) if without_replacement else set()))
        return drawn

    first = siblings(ctx, widths[0])
    tokens, parents, rows = list(first), [-1] * len(first), [world.q(ctx)] * len(first)
    for node, token in enumerate(first[:-1]):
        here = ctx + (token,)
        second = siblings(here, widths[1])
        tokens += second
        parents += [node] * len(second)
        rows += [world.q(here)] * len(second)
    meta = {WITHOUT_REPLACEMENT: True} if without_replacement else {}
    return Draft(tokens, parents, q=torch.stack(rows), sampled_children=True, meta=meta)


def tree_sampled_without(world: World, ctx: tuple, rng: random.Random) -> Draft:
    return tree_sampled(world, ctx, rng, without_replacement=True)


# ---------------------------------------------------------------- the experiment


def node_contexts(draft: Draft, ctx: tuple) -> list[tuple]:
    """Context seen by each logits row: the root's, then each node's root-to-node path."""
    contexts = [ctx]
    for token, parent in zip(draft.tokens, draft.parents, strict=True):
        contexts.append(contexts[parent + 1] + (token,))
    return contexts


def first_two_counts(world: World, build: Callable, trials: int, seed: int,
                     verifier: Callable = verify) -> Tensor:
    """Counts [V, V] of the first two emitted tokens over independent two-token decodes."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(trials):
        out: list[int] = []
        while len(out) < 2:
            ctx = tuple(out)
            draft = build(world, ctx, rng)
            logits = torch.stack([world.logits(c) for c in node_contexts(draft, ctx)])
            verdict = verifier(draft, logits, world.cfg, generator)
            out += [draft.tokens[i] for i in verdict.accepted] + [verdict.next_token]
        counts[out[0], out[1]] += 1
    return counts


def target_joint(world: World) -> Tensor:
    first = world.p(())
    return torch.stack([first[a] * world.p((a,)) for a in range(V)])


def chi_square_pvalue(counts: Tensor, probs: Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expected below `min_expected` are pooled
    into one bin. A token with probability 0 that occurs at all gives p-value 0."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    keep = expected >= min_expected
    observed = torch.cat([counts[keep], counts[~keep & (probs > 0)].sum().view(1)])
    expected = torch.cat([expected[keep], expected[~keep & (probs > 0)].sum().view(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def assert_lossless(counts: Tensor, world: World) -> None:
    joint = target_joint(world)
    p_first = chi_square_pvalue(counts.sum(1), joint.sum(1))
    p_joint = chi_square_pvalue(counts, joint)
    assert p_first > ALPHA, f"first token off the target distribution (p-value {p_first:.2e})"
    assert p_joint > ALPHA, f"first two tokens off the target distribution (p-value {p_joint:.2e})"


@dataclass(frozen=True)
class Mode:
    name: str
    build: Callable
    cfg: SamplingConfig
    draft_temperature: float = 1.0


MODES = [
    Mode("chain-q", chain_sampled, SamplingConfig(temperature=1.0)),
    Mode("chain-q-topk", chain_sampled, SamplingConfig(temperature=0.7, top_k=4), draft_temperature=1.3),
    Mode("chain-q-confidence-cut", chain_confidence_cut, SamplingConfig(temperature=1.0)),
    Mode("chain-onehot-topp", chain_argmax, SamplingConfig(temperature=1.3, top_p=0.8)),
    Mode("tree-topk", tree_topk, SamplingConfig(temperature=1.0)),
    Mode("tree-topk-topp", tree_topk, SamplingConfig(temperature=0.8, top_p=0.9)),
    Mode("mss", tree_sampled, SamplingConfig(temperature=1.0)),
    Mode("mss-topp", tree_sampled, SamplingConfig(temperature=1.3, top_p=0.85), draft_temperature=0.7),
    Mode("mss-without", tree_sampled_without, SamplingConfig(temperature=1.0), draft_temperature=0.6),
    Mode("mss-without-topk", tree_sampled_without, SamplingConfig(temperature=0.7, top_k=5), draft_temperature=0.5),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.name)
def test_emitted_tokens_follow_target(mode: Mode):
    world = World(mode.cfg, mode.draft_temperature, seed=11)
    counts = first_two_counts(world, mode.build, TRIALS, seed=1234)
    assert_lossless(counts, world)


def test_draft_differs_from_target():
    """The experiment only means something if q is far from p (acceptance well below 1)."""
    world = World(SamplingConfig(temperature=1.0), seed=11)
    contexts = [()] + [(token,) for token in range(V)]
    distances = [0.5 * float((world.p(c) - world.q(c).double()).abs().sum()) for c in contexts]
    assert sum(distances) / len(distances) > 0.3


def test_detector_has_power(monkeypatch):
    """The same detector on a known-wrong verifier must fire: chain verification whose
    rejection draws from p instead of norm(max(0, p - q)) (a classic bug)."""
    def residual_is_p(probs, q, tokens, n_accepted):
        return probs[n_accepted]

    monkeypatch.setattr(verify_module, "chain_weights", residual_is_p)
    world = World(SamplingConfig(temperature=1.0), seed=11)
    counts = first_two_counts(world, chain_sampled, TRIALS // 2, seed=99)
    joint = target_joint(world)
    assert chi_square_pvalue(counts.sum(1), joint.sum(1)) < ALPHA
    assert chi_square_pvalue(counts, joint) < ALPHA


def test_a_cut_that_peeks_at_the_admitted_token_is_detected():
    """The counterexample behind DSpark's stop-at-first-non-improvement rule: admitting a
    drafted token depending on the token itself biases the output towards q's mode."""
    world = World(SamplingConfig(temperature=1.0), seed=11)
    counts = first_two_counts(world, lambda w, c, r: chain_confidence_cut(w, c, r, peek=True), TRIALS, seed=1234)
    joint = target_joint(world)
    assert chi_square_pvalue(counts.sum(1), joint.sum(1)) < ALPHA


def test_chi_square_pvalue_is_calibrated():
    """Exact samples from the target pass; the p-value of a fair draw is not tiny."""
    generator = torch.Generator().manual_seed(5)
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    draws = torch.multinomial(probs, 20_000, replacement=True, generator=generator)
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    assert chi_square_pvalue(counts, probs) > ALPHA
    shifted = counts.clone()
    shifted[0] -= 400
    shifted[1] += 400
    assert chi_square_pvalue(shifted, probs) < ALPHA
    impossible = counts.clone()
    impossible[-1] = 1
    assert chi_square_pvalue(impossible, probs) == 0.0
