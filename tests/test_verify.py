"""Verification rules (torch reference) on hand-computed cases; statistics live in
test_lossless_stats.py and the Triton kernels in test_verify_triton.py."""

from __future__ import annotations

import pytest
import torch

import bench.core.verify as verify_module
from bench.core.draft import Draft
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from bench.core.verify import (
    WITHOUT_REPLACEMENT,
    Verdict,
    chain_reference,
    chain_weights,
    sample_inverse_cdf,
    verify,
    verify_chain,
    verify_greedy,
    verify_multidraft,
)

SAMPLE = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig(temperature=0.0)


def peaked(targets: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits whose row i has its maximum at targets[i]."""
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def log_probs(rows: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax (T=1) is exactly `rows` (zeros become -inf)."""
    return torch.tensor(rows).log()


# ---------------------------------------------------------------- greedy


def test_greedy_chain_accepts_matching_prefix():
    draft = Draft.chain([3, 4, 5])
    assert verify(draft, peaked([3, 4, 5, 6]), GREEDY) == Verdict([0, 1, 2], 6)
    assert verify(draft, peaked([3, 7, 5, 6]), GREEDY) == Verdict([0], 7)
    assert verify(draft, peaked([1, 4, 5, 6]), GREEDY) == Verdict([], 1)


def test_greedy_tree_walks_first_matching_child():
    # root -> {0:a=2, 1:b=3 (dup of 2's token), 2:c=3}; 1 -> {3:4}; 2 -> {4:4}
    draft = Draft(tokens=[2, 3, 3, 4, 4], parents=[-1, -1, -1, 1, 2])
    logits = peaked([3, 0, 4, 0, 9, 9])
    assert verify(draft, logits, GREEDY) == Verdict([1, 3], 9)  # node 1 wins over its twin node 2


def test_greedy_ties_take_the_first_maximum():
    logits = torch.zeros(1, 6)
    logits[0, [2, 5]] = 1.0
    assert verify(Draft.empty(), logits, GREEDY).next_token == 2


def test_greedy_ignores_q():
    q = torch.full((2, 10), 0.1)
    assert verify(Draft.chain([3, 4], q), peaked([3, 4, 5]), GREEDY) == Verdict([0, 1], 5)


# ---------------------------------------------------------------- sampling chains


def chain(tokens: list[int], probs: list[list[float]], q: list[list[float]] | None, uniforms: list[float]):
    n_accepted, token = chain_reference(torch.tensor(probs), None if q is None else torch.tensor(q),
                                        torch.tensor(tokens, dtype=torch.long), torch.tensor(uniforms))
    return int(n_accepted), int(token)


def test_chain_accepts_with_ratio_p_over_q():
    p = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]
    q = [[0.2, 0.5, 0.3]]  # drafted token 1: accept with probability 0.3 / 0.5 = 0.6
    assert chain([1], p, q, [0.59, 0.0]) == (1, 0)  # accepted; bonus from p[1] with u=0 -> token 0
    assert chain([1], p, q, [0.61, 0.0])[0] == 0
    # rejected: residual max(0, p - q) = [0.3, 0, 0] -> always token 0
    assert chain([1], p, q, [0.61, 0.99]) == (0, 0)


def test_chain_with_q_equal_p_accepts_everything():
    p = torch.randn(4, 7).softmax(-1)
    n_accepted, _ = chain_reference(p, p[:3], torch.tensor([1, 2, 3]), torch.full((4,), 0.999999))
    assert int(n_accepted) == 3


def test_chain_never_accepts_or_emits_a_token_outside_p():
    p = [[0.0, 0.5, 0.5], [0.3, 0.3, 0.4]]
    for u in (0.0, 0.5, 0.999):
        n_accepted, token = chain([0], p, None, [u, u])  # one-hot draft on a masked token
        assert n_accepted == 0 and token in (1, 2)
        n_accepted, token = chain([0], p, [[0.9, 0.05, 0.05]], [u, u])
        assert n_accepted == 0 and token in (1, 2)


def test_chain_one_hot_residual_removes_the_drafted_token():
    p = [[0.6, 0.4, 0.0], [1.0, 0.0, 0.0]]
    weights = chain_weights(torch.tensor(p), None, torch.tensor([0]), torch.tensor(0))
    assert torch.equal(weights, torch.tensor([0.0, 0.4, 0.0]))


def test_chain_residual_without_mass_falls_back_to_p():
    p = torch.tensor([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    weights = chain_weights(p, p[:1], torch.tensor([1]), torch.tensor(0))  # q = p: residual is 0
    assert torch.equal(weights, p[0])


def test_chain_bonus_comes_from_the_row_after_the_last_node():
    p = [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert chain([1, 2], p, None, [0.3, 0.3, 0.5]) == (2, 0)
    assert chain([], [[0.0, 0.0, 1.0]], None, [0.5]) == (0, 2)


def test_verify_chain_builds_the_verdict():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_chain(Draft.chain([1, 0]), probs, torch.tensor([0.5, 0.5, 0.5])) == Verdict([0], 2)


def test_sample_inverse_cdf_maps_uniforms_to_tokens():
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])  # normalised: 0.5, 0.25, 0.25
    assert int(sample_inverse_cdf(weights, torch.tensor(0.0))) == 1
    assert int(sample_inverse_cdf(weights, torch.tensor(0.49))) == 1
    assert int(sample_inverse_cdf(weights, torch.tensor(0.51))) == 3
    assert int(sample_inverse_cdf(weights, torch.tensor(0.76))) == 4
    assert int(sample_inverse_cdf(weights, torch.tensor(1.0))) == 4  # past the end: last positive token
    grid = (torch.arange(1000) + 0.5) / 1000
    drawn = torch.stack([sample_inverse_cdf(weights, u) for u in grid])
    assert torch.bincount(drawn, minlength=6).tolist() == [0, 500, 0, 250, 250, 0]


# ---------------------------------------------------------------- sampling trees


def test_deterministic_tree_descends_on_the_drawn_token():
    draft = Draft(tokens=[1, 2, 0], parents=[-1, -1, 1])
    logits = log_probs([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert verify(draft, logits, SAMPLE) == Verdict([1, 2], 1)


def test_mss_updates_the_residual_after_a_rejection():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.2, 0.5, 0.3]] * 2)
    draft = Draft(tokens=[1, 0], parents=[-1, -1], q=q, sampled_children=True)
    # child 0 (token 1): 0.7 * 0.5 >= 0.3 -> rejected; r = norm(max(0, p - q)) = [1, 0, 0]
    # child 1 (token 0): accepted for any u since r(0) = 1 > u * 0.2; then emit from its row [0, 0, 1]
    assert verify_multidraft(draft, p, torch.tensor([0.7, 0.999, 0.5])) == Verdict([1], 2)


def test_mss_without_replacement_updates_q():
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25] * 4, [0.25] * 4])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2)
    uniforms = torch.tensor([0.9, 0.8, 0.5])
    # child 0 (token 0): 0.9 * 0.4 >= 0.1 -> rejected; r = [0, 1/3, 0, 2/3]
    # child 1 (token 1), drawn from q without token 0 = [0, .5, 1/3, 1/6]: 0.8 * 0.5 >= 1/3 -> rejected;
    # r = norm(max(0, r - q')) = [0, 0, 0, 1] -> emit 3. Plain MSS would accept (0.8 * 0.3 < 1/3).
    without = Draft(tokens=[0, 1], parents=[-1, -1], q=q, sampled_children=True, meta={WITHOUT_REPLACEMENT: True})
    assert verify_multidraft(without, p, uniforms) == Verdict([], 3)
    plain = Draft(tokens=[0, 1], parents=[-1, -1], q=q, sampled_children=True)
    assert verify_multidraft(plain, p, uniforms).accepted == [1]


def test_sampled_chain_and_one_child_mss_agree():
    """A chain is MSS with one child per node: both rules give the same verdicts."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        probs = torch.randn(4, 6, generator=generator).mul(2).softmax(-1)
        q = torch.randn(3, 6, generator=generator).softmax(-1)
        tokens = torch.multinomial(q, 1, generator=generator).squeeze(1).tolist()
        uniforms = torch.rand(4, generator=generator)
        as_chain = verify_chain(Draft.chain(tokens, q), probs, uniforms)
        as_tree = verify_multidraft(Draft(tokens, [-1, 0, 1], q=q, sampled_children=True), probs, uniforms)
        assert as_chain.accepted == as_tree.accepted
        if len(as_chain.accepted) < 3:  # the bonus draw differs only in how float sums round
            assert as_chain.next_token == as_tree.next_token


# ---------------------------------------------------------------- verify(): seeds, dispatch, input checks


def test_verify_is_reproducible_and_consumes_n_plus_one_uniforms():
    logits = torch.randn(4, 50)
    q = torch.randn(3, 50).softmax(-1)
    draft = Draft.chain([1, 2, 3], q)
    first = verify(draft, logits, SAMPLE, torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(7)
    assert verify(draft, logits, SAMPLE, generator) == first
    reference = torch.Generator().manual_seed(7)
    torch.rand(4, generator=reference)
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=reference))


def test_cpu_never_uses_triton():
    assert not verify_module._triton_enabled(torch.zeros(1))


@pytest.mark.parametrize("draft, rows, message", [
    (Draft.chain([1, 2]), 2, "logits shape"),
    (Draft.chain([1, 20]), 3, "outside the vocabulary"),
    (Draft.chain([1, 2], q=torch.full((2, 5), 0.2)), 3, "draft.q shape"),
    (Draft([1, 2], [-1, -1], q=torch.full((2, 10), 0.1)), 3, "sampled_children=True"),
    (Draft([1, 2], [-1, -1], sampled_children=True), 3, "must record q"),
    (Draft([1, 1], [-1, -1], q=torch.full((2, 10), 0.1), sampled_children=True,
           meta={WITHOUT_REPLACEMENT: True}), 3, "repeated token"),
    (Draft([1, 2], [-1, -1], q=torch.randn(2, 10).softmax(-1), sampled_children=True,
           meta={WITHOUT_REPLACEMENT: True}), 3, "share one q row"),
])
def test_bad_drafts_raise_bench_error(draft, rows, message):
    with pytest.raises(BenchError, match=message):
        verify(draft, torch.randn(rows, 10), SAMPLE, torch.Generator().manual_seed(0))


def test_greedy_walk_matches_reference_on_random_trees():
    """verify_greedy against an independent path search (every root-to-node path)."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(100):
        n = int(torch.randint(1, 12, (1,), generator=generator))
        parents = [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(n)]
        logits = torch.randn(n + 1, 4, generator=generator)
        tokens = torch.randint(0, 4, (n,), generator=generator).tolist()
        verdict = verify_greedy(Draft(tokens, parents), logits)
        targets = logits.argmax(-1).tolist()
        path, node = [], -1
        while True:  # first child (lowest index) carrying the target
            kids = [c for c in range(n) if parents[c] == node and tokens[c] == targets[node + 1]]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        assert verdict == Verdict(path, targets[node + 1])
