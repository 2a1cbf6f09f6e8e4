"""Metrics on hand-built turn records whose answers are worked out by hand."""

from __future__ import annotations

import math

import pytest

from bench import metrics


def make_turn(question_id="q1", turn=1, tokens=10, ttft=0.5, decode_time=1.0, proposed=(), accepted=(),
              exact_match=None, draft_time=0.0, verify_time=0.0) -> dict:
    return {"question_id": question_id, "turn": turn, "tokens": list(range(tokens)), "ttft": ttft,
            "decode_time": decode_time, "proposed_lengths": list(proposed), "accept_lengths": list(accepted),
            "tree_sizes": list(proposed), "exact_match": exact_match, "draft_time": draft_time,
            "verify_time": verify_time}


# Five rounds (proposed, accepted): (3,3) (3,1) (3,0) | (3,2) (2,2), split over two turns.
ROUNDS = [make_turn("q1", 1, tokens=10, ttft=0.5, decode_time=1.8, proposed=(3, 3, 3), accepted=(3, 1, 0)),
          make_turn("q2", 1, tokens=4, ttft=0.3, decode_time=0.6, proposed=(3, 2), accepted=(2, 2))]


def test_tau_pooled():
    assert metrics.tau(ROUNDS) == pytest.approx((3 + 1 + 0 + 2 + 2 + 5) / 5)  # Σ(n_r + 1) / #rounds
    assert math.isnan(metrics.tau([make_turn()]))  # no rounds


def test_tau_pools_rounds_not_turns():
    long = make_turn("a", proposed=[1] * 9, accepted=[1] * 9)  # τ = 2 in every round
    short = make_turn("b", proposed=[1], accepted=[0])  # τ = 1
    assert metrics.tau([long, short]) == pytest.approx(19 / 10)  # not the per-turn mean 1.5


def test_tau_ceiling_is_one_plus_the_mean_draft_depth():
    assert metrics.tau_ceiling(ROUNDS) == pytest.approx(1 + (3 + 3 + 3 + 3 + 2) / 5)  # every draft accepted
    assert metrics.tau(ROUNDS) <= metrics.tau_ceiling(ROUNDS)
    assert math.isnan(metrics.tau_ceiling([make_turn()]))


def test_acceptance_unconditional():
    # u_i = #(n ≥ i) / #(proposed ≥ i)
    assert metrics.acceptance_unconditional(ROUNDS) == pytest.approx([4 / 5, 3 / 5, 1 / 4])


def test_acceptance_conditional():
    # a_i = #(n ≥ i) / #(n ≥ i-1 and proposed ≥ i); the (2,2) round offered no 3rd token
    assert metrics.acceptance_conditional(ROUNDS) == pytest.approx([4 / 5, 3 / 4, 1 / 2])


def test_fixed_length_identities():
    """For a fixed γ: E[τ] = 1 + Σ u_i and u_i = Π_{j≤i} a_j (the chain model of Leviathan et al. 2023)."""
    accepted = [3, 1, 0, 2, 2, 3, 0, 1]
    turns = [make_turn(proposed=[3] * len(accepted), accepted=accepted)]
    u = metrics.acceptance_unconditional(turns)
    a = metrics.acceptance_conditional(turns)
    assert metrics.tau(turns) == pytest.approx(1 + sum(u))
    assert u == pytest.approx([math.prod(a[:i + 1]) for i in range(3)])


def test_acceptance_position_never_offered():
    turns = [make_turn(proposed=[0, 0], accepted=[0, 0])]  # AR: nothing drafted
    assert metrics.acceptance_unconditional(turns) == [] == metrics.acceptance_conditional(turns)
    assert metrics.accept_histogram(turns) == {1: 2}


def test_histogram():
    assert metrics.accept_histogram(ROUNDS) == {1: 1, 2: 1, 3: 2, 4: 1}  # counts of τ_r = n_r + 1


def test_draft_efficiency():
    assert metrics.draft_efficiency(ROUNDS) == pytest.approx(8 / 14)


def test_times():
    assert metrics.tpot(ROUNDS) == pytest.approx((1.8 + 0.6) / (9 + 3))  # first token is TTFT's
    assert metrics.tokens_per_second(ROUNDS) == pytest.approx(14 / (0.5 + 1.8 + 0.3 + 0.6))
    assert metrics.mean_ttft(ROUNDS) == pytest.approx(0.4)
    assert math.isnan(metrics.tokens_per_second([]))


def test_speedup_ratio_of_sums_on_paired_turns():
    base = [make_turn("q1", 1, tokens=10, ttft=0.0, decode_time=1.0),
            make_turn("q2", 1, tokens=30, ttft=1.0, decode_time=8.0),
            make_turn("q1", 2, tokens=100, ttft=0.0, decode_time=1.0)]  # method never ran it
    method = [make_turn("q1", 1, tokens=10, ttft=0.1, decode_time=0.4),
              make_turn("q2", 1, tokens=30, ttft=1.0, decode_time=5.0),
              make_turn("q3", 1, tokens=5, ttft=0.0, decode_time=100.0)]  # no baseline turn
    # (10 s / 40 tok) / (6.5 s / 40 tok); the mean of per-turn ratios would be (2 + 1.5) / 2
    assert metrics.speedup(method, base) == pytest.approx(10 / 6.5)
    assert math.isnan(metrics.speedup(method[2:], base))


def test_bootstrap_interval():
    base = [make_turn(f"q{i}", tokens=20 + i, decode_time=1.0 + 0.1 * i) for i in range(12)]
    method = [make_turn(f"q{i}", tokens=20 + i, decode_time=0.5 + 0.07 * (i % 5)) for i in range(12)]
    point = metrics.speedup(method, base)
    low, high = metrics.speedup_interval(method, base, samples=400, seed=3)
    assert low <= point <= high and low < high
    assert metrics.speedup_interval(method, base, samples=400, seed=3) == (low, high)  # seeded
    assert all(math.isnan(x) for x in metrics.speedup_interval(method[:1], base))


def test_match_rate_ignores_none():
    turns = [make_turn(exact_match=m) for m in (True, False, None, True)]
    assert metrics.match_rate(turns) == pytest.approx(2 / 3)
    assert math.isnan(metrics.match_rate([make_turn(exact_match=None)]))
    assert math.isnan(metrics.match_rate([{k: v for k, v in make_turn().items() if k != "exact_match"}]))


def test_summarize():
    row = metrics.summarize(ROUNDS, base=ROUNDS)
    assert row["turns"] == 2 and row["new_tokens"] == 14
    assert row["tau"] == pytest.approx(2.6) and row["speedup"] == pytest.approx(1.0)
    assert row["accept_hist"] == {1: 1, 2: 1, 3: 2, 4: 1}
    assert "speedup" not in metrics.summarize(ROUNDS)
    assert math.isnan(row["speedup_model"])  # no per-round times recorded


def test_modelled_speedup():
    # baseline: 4 one-token rounds of 0.1 s; method: 2 rounds, τ = 2.5, 0.05 s draft + 0.15 s verify each
    base = [make_turn("q1", proposed=(0,) * 4, accepted=(0,) * 4, verify_time=0.4)]
    method = [make_turn("q1", proposed=(3, 3), accepted=(2, 1), draft_time=0.1, verify_time=0.3)]
    assert metrics.modelled_speedup(method, base) == pytest.approx(2.5 * 0.1 / 0.2)
