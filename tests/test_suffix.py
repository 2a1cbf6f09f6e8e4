"""SuffixDecoding: the suffix tree counts every occurrence of every substring up to its depth,
drafts follow the most frequent continuation with Arctic's probability estimates and adaptive
size, the global tree lets a reply draft from the replies before it, and decoding stays the
target's own greedy tokens. Where `arctic_inference` is installed, its drafts are ours."""

from __future__ import annotations

import random

import pytest

from methods.suffix import Options, SuffixTree


def occurrences(sequences: list[list[int]], pattern: list[int]) -> int:
    return sum(1 for s in sequences for i in range(len(s) - len(pattern) + 1) if s[i:i + len(pattern)] == pattern)


def test_every_node_counts_the_occurrences_of_its_substring():
    rng = random.Random(0)
    sequences = [[rng.randrange(4) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    tree = SuffixTree(max_depth=5)
    for number, sequence in enumerate(sequences):
        for start in range(0, len(sequence), 7):  # grown in pieces, as replies are
            tree.extend(number, sequence[start:start + 7])

    def walk(node, prefix):
        for token, child in node.children.items():
            assert child.count == occurrences(sequences, prefix + [token]), prefix + [token]
            walk(child, prefix + [token])
    walk(tree.root, [])
    assert tree.root.count == sum(map(len, sequences))
    assert max(child.depth for child in tree.root.children.values()) == 1


def test_a_draft_follows_the_most_frequent_continuation_while_likely_enough():
    tree = SuffixTree(max_depth=8)
    tree.extend(0, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4])
    options = Options()
    score, length, draft = tree.speculate([7, 1, 2], options)
    # "1 2" occurs 3 times: then 3 (twice, p 2/3), 9 (p 2/3), 1, 2 ... capped by the match (2 x 1.0)
    assert length == 2 and draft.tokens == [3, 9] and score == pytest.approx(2 / 3 + 2 / 3)
    _, _, longer = tree.speculate([7, 1, 2], Options(max_spec_factor=4.0))
    assert longer.tokens[:4] == [3, 9, 1, 2]
    _, _, strict = tree.speculate([7, 1, 2], Options(min_token_prob=0.7))
    assert strict.tokens == []  # 2/3 < 0.7
    _, _, tree_draft = tree.speculate([7, 1, 2], Options(tree=True, max_spec_tokens=3))
    assert sorted(tree_draft.tokens[:2]) == [3, 4] or tree_draft.tokens[0] == 3  # both branches of "1 2"
    assert tree_draft.parents[0] == -1


def test_decoding_is_the_targets_and_a_repeated_reply_drafts_from_the_first(default_target, one_thread):
    import bench.registry as registry
    from bench.core.decode import DecodeConfig
    from bench.core.sampling import SamplingConfig
    from bench.core.target import chat_prompt

    prompt = chat_prompt(default_target.tokenizer, [{"role": "user", "content": "Name three colours."}])
    config = DecodeConfig(max_new_tokens=32, sampling=SamplingConfig(0.0), eos_token_ids=tuple(
        default_target.eos_token_ids))
    expected = registry.build_decoder("ar", default_target, {}).run_turn(prompt, config).tokens
    decoder = registry.build_decoder("suffix", default_target, {})
    first = decoder.run_turn(prompt, config)
    second = decoder.run_turn(prompt, config)  # the same reply again: the global tree holds it
    assert first.tokens == expected and second.tokens == expected
    assert sum(second.accept_lengths) > sum(first.accept_lengths)
    alone = registry.build_decoder("suffix", default_target, {"global_tree": False})  # no memory across turns
    once = alone.run_turn(prompt, config)
    again = alone.run_turn(prompt, config)
    assert once.tokens == again.tokens == expected and once.accept_lengths == again.accept_lengths


@pytest.mark.parametrize("tree", [False, True])
def test_drafts_equal_arctic_inference_where_it_is_installed(tree):
    """Arctic's SuffixDecodingCache over a prompt and earlier replies (its global tree) and
    ours: the same draft tokens, parents and score on random sequences of a small vocabulary
    (many ties), paths and trees."""
    arctic = pytest.importorskip("arctic_inference.suffix_decoding")
    rng = random.Random(1)
    for trial in range(60):
        cache = arctic.SuffixDecodingCache(max_tree_depth=8)
        ours_global = SuffixTree(8)
        for earlier in range(rng.randrange(3)):  # finished replies of other requests
            reply = [rng.randrange(6) for _ in range(rng.randrange(5, 30))]
            cache.start_request(("old", trial, earlier), [0])
            cache.add_active_response(("old", trial, earlier), reply)
            cache.stop_request(("old", trial, earlier))
            ours_global.extend(100 + earlier, reply)
        prompt = [rng.randrange(6) for _ in range(rng.randrange(10, 60))]
        reply = [rng.randrange(6) for _ in range(rng.randrange(5, 40))]
        cache.start_request(trial, prompt)
        cache.add_active_response(trial, reply)
        ours = SuffixTree(8)
        ours.extend(0, prompt + reply)
        ours_global.extend(0, reply)
        context = (prompt + reply)[-8:]
        factor, least = rng.choice([1.0, 2.0]), rng.choice([0.0, 0.1, 0.3])
        want = cache.speculate(trial, context, max_spec_tokens=8, max_spec_factor=factor, min_token_prob=least,
                               use_tree_spec=tree)
        options = Options(max_tree_depth=8, max_spec_tokens=8, max_spec_factor=factor, min_token_prob=least,
                          tree=tree)
        local, other = ours.speculate(context, options), ours_global.speculate(context, options)
        score, _, draft = local if local[0] >= other[0] else other
        assert score == pytest.approx(want.score, rel=1e-5)
        assert draft.tokens == list(want.token_ids) and draft.parents == list(want.parents)
