"""Prompt lookup and Lookahead: drafting logic, and lossless decoding through the shared loop."""

from __future__ import annotations

import pytest
import torch
from test_engine import engine_for, tiny_model

from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.sampling import SamplingConfig
from methods.lookahead import LookaheadDrafter, NgramPool, trie
from methods.pld import PromptLookupDrafter, lookup


def test_lookup_takes_the_first_match_of_the_longest_ngram():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 1, 2, 3]
    assert lookup(tokens, max_ngram=3, num_pred_tokens=2) == [9, 1]  # first occurrence, left to right
    assert lookup([4, 5, 6, 5], max_ngram=3, num_pred_tokens=3) == [6, 5]  # falls back to 1-gram
    assert lookup([1, 2, 3], max_ngram=3, num_pred_tokens=5) == []  # no earlier occurrence
    assert lookup([7, 7], max_ngram=3, num_pred_tokens=4) == [7]  # the copy may reach the end


def test_ngram_pool_keeps_the_most_recent_per_key():
    pool = NgramPool(capacity=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (2, 9, 9)]:
        pool.add(ngram)
    assert pool.continuations(1) == [(2, 3), (6, 7)]
    assert pool.continuations(2) == [(9, 9)] and pool.continuations(3) == []


def test_trie_merges_shared_prefixes():
    tokens, parents = trie([(5, 6, 7), (5, 6, 8), (9,)])
    assert tokens == [5, 6, 7, 8, 9]
    assert parents == [-1, 0, 1, 1, -1]


def test_lookahead_window_logits_equal_each_column_trajectory():
    """The extra-branch mask: token (level l, column i) must see exactly the root, level 0
    up to column i and its own column below it, at position root+i+l."""
    model = tiny_model(seed=7)
    engine = engine_for(model)
    prompt = torch.randint(0, 211, (10,)).tolist()
    drafter = LookaheadDrafter(ngram=4, window=3, guesses=2)
    drafter.levels = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    drafter.pool = NgramPool(2)
    engine.prefill(torch.tensor(prompt))
    draft = drafter.propose(type("S", (), {"root": 99})())
    assert len(draft) == 0  # empty pool: nothing to verify, only the window runs
    tokens, positions, mask = draft.verify_inputs(99, engine.length)
    out = engine.forward(tokens, positions, mask)
    for level in range(3):
        for column in range(3):
            trajectory = [99] + [11, 12, 13][: column + 1] + [row[column] for row in drafter.levels[1: level + 1]]
            with torch.no_grad():
                ref = model(torch.tensor(prompt + trajectory)[None]).logits[0, -1]
            row = 1 + level * 3 + column
            assert (out.logits[row] - ref).abs().max() < 1e-4, (level, column)


def _prompts(target, n=3):
    questions = ["Write a Python function that reverses a list, then explain it.",
                 "List the first ten square numbers, separated by commas.",
                 "Repeat the phrase 'speculative decoding is lossless' three times."]
    ids = []
    for question in questions[:n]:
        encoded = target.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                       add_generation_prompt=True, tokenize=True)
        ids.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return ids


@pytest.fixture(scope="module")
def greedy_baseline(default_target):
    config = DecodeConfig(max_new_tokens=48, eos_token_ids=tuple(default_target.eos_token_ids))
    return config, [(p, decode(default_target.engine, Drafter(), p, config)) for p in _prompts(default_target)]


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("drafter", [PromptLookupDrafter(), LookaheadDrafter()], ids=["pld", "lookahead"])
def test_greedy_decoding_reproduces_the_baseline(drafter, default_target, greedy_baseline):
    config, baselines = greedy_baseline
    rounds = base_rounds = 0
    for prompt, base in baselines:
        ours = decode(default_target.engine, drafter, prompt, config)
        assert ours.tokens == base.tokens
        assert sum(ours.accept_lengths) + len(ours.accept_lengths) + 1 >= len(ours.tokens)
        rounds, base_rounds = rounds + len(ours.accept_lengths), base_rounds + len(base.accept_lengths)
    assert rounds < base_rounds  # it did accept drafts


def test_sampling_runs_through_deterministic_tree_verification(default_target):
    config = DecodeConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, top_p=0.95),
                          eos_token_ids=tuple(default_target.eos_token_ids))
    prompt = _prompts(default_target, 1)[0]
    for drafter in (PromptLookupDrafter(), LookaheadDrafter()):
        generator = torch.Generator().manual_seed(1)
        result = decode(default_target.engine, drafter, prompt, config, generator)
        assert 0 < len(result.tokens) <= 24
