"""SpecInfer trees: greedy output equals the AR baseline; sampled trees keep the target's
distribution (multi-step speculative sampling, with and without replacement)."""

from __future__ import annotations

import pytest
import torch
from sps_helpers import load_tiny_target, make_tiny_target_folder, noisy_draft, three_token_joint

from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.sampling import SamplingConfig
from methods.specinfer import SpecInferDrafter

PROMPTS = [[1, 504, 3213, 28, 1790], [1, 77, 9, 4000, 12, 12, 12, 880, 301, 45, 2, 17]]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


@pytest.mark.parametrize("widths,noise", [((2, 2, 2, 1), 0.0), ((2, 2, 2, 1), 0.2), ((3, 1), 0.1), ((1, 1, 1), 3.0)])
def test_greedy_tree_equals_ar(tiny_target, widths, noise):
    draft = noisy_draft(tiny_target, noise)
    config = DecodeConfig(max_new_tokens=30, eos_token_ids=())
    for prompt in PROMPTS:
        base = decode(tiny_target.engine, Drafter(), prompt, config)
        result = decode(tiny_target.engine, SpecInferDrafter(draft, widths), prompt, config)
        assert result.tokens == base.tokens
        assert max(result.proposed_lengths) <= len(widths)
        if noise == 0.0:  # the target drafting for itself: the whole top-1 path is accepted
            assert result.accept_lengths[:-1] == result.proposed_lengths[:-1]


def test_tree_shape_and_draft_cache(tiny_target):
    draft = noisy_draft(tiny_target, 0.1)
    drafter = SpecInferDrafter(draft, (2, 2, 1))
    config = DecodeConfig(max_new_tokens=20, eos_token_ids=())
    result = decode(tiny_target.engine, drafter, PROMPTS[0], config)
    assert set(result.tree_sizes[:-1]) == {2 + 4 + 4}
    # After the turn the draft cache holds committed tokens only.
    assert draft.length == drafter.seen <= len(PROMPTS[0]) + len(result.tokens)


def test_tree_levels_see_only_their_ancestors(tiny_target):
    """The draft's logits for a depth-2 node equal a plain forward of root -> parent -> node."""
    draft = noisy_draft(tiny_target, 0.0)
    drafter = SpecInferDrafter(draft, (2, 2, 1))
    prompt = PROMPTS[1]
    config = DecodeConfig(max_new_tokens=8, eos_token_ids=())
    state = type("S", (), {})()
    state.tokens, state.prompt_len, state.generated = prompt + [5], len(prompt), [5]
    state.config, state.generator = config, None
    drafter.begin(state, None)
    tree = drafter.propose(state)
    depth2 = [i for i, d in enumerate(tree.depths()) if d == 2]
    depth3 = [i for i, d in enumerate(tree.depths()) if d == 3]
    for node, child in zip(depth2, depth3):  # width 1 at depth 3: one child per depth-2 node
        path = []
        walk = node
        while walk >= 0:
            path.insert(0, tree.tokens[walk])
            walk = tree.parents[walk]
        logits = tiny_target.engine.prefill(torch.tensor(prompt + [5] + path)).logits[-1]
        assert tree.tokens[child] == int(logits.argmax())


@pytest.mark.slow  # ~30-60 s on 2 cores
@pytest.mark.parametrize("mode", ["sample", "sample_wor", "topk"])
def test_sampled_tree_follows_the_target_distribution(tiny_target, mode, one_thread):
    """Chi-square on the first three generated tokens at T=1, top-k 3, against
    p(a) p(b|a) p(c|ab): a comes from the prefill, b and c from the first tree (depth 2)."""
    from test_lossless_stats import ALPHA, chi_square_pvalue

    cfg = SamplingConfig(temperature=1.0, top_k=3)
    prompt = PROMPTS[0]
    engine = tiny_target.engine
    index, joint = three_token_joint(engine, prompt, cfg)
    drafter = SpecInferDrafter(noisy_draft(tiny_target, 0.3), (3, 2), mode)
    counts = torch.zeros(len(joint) + 1)
    generator = torch.Generator().manual_seed(0)
    config = DecodeConfig(max_new_tokens=4, sampling=cfg)  # room for a depth-2 tree after the first token
    for _ in range(2500):
        tokens = tuple(decode(engine, drafter, prompt, config, generator).tokens[:3])
        counts[index.get(tokens, len(joint))] += 1
    assert chi_square_pvalue(counts, torch.tensor(joint + [0.0])) > ALPHA
