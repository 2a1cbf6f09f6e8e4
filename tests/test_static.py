"""The static verify pass (bench.core.static): fixed-shape buffers per row bucket, K/V by
index_copy at slot indices, attention over the cache's whole capacity under a mask, grouped
queries folded into rows. On CUDA it is captured as one graph per bucket; here it runs
eagerly and must agree with the engine's dynamic path."""

from __future__ import annotations

import pytest
import torch

import bench.registry as registry
from bench.core.decode import DecodeConfig
from bench.core.draft import Draft
from bench.core.engine import Engine
from bench.core.sampling import SamplingConfig
from bench.core.static import enable_static
from bench.core.target import chat_prompt, load_state_dict


@pytest.fixture(scope="module")
def engines(default_target):
    state = load_state_dict(default_target.path)
    dynamic = Engine(default_target.config, state)
    return dynamic, enable_static(Engine(default_target.config, state))


def test_static_passes_equal_the_dynamic_ones(engines, default_target, one_thread):
    """Chains of 1-40 rows (padded to their bucket), a tree, taps: the same logits (to fp32
    rounding of a different attention kernel) and the same argmax; the cache after the pass
    holds the same K/V for the real rows; a pass past the largest bucket runs dynamic."""
    dynamic, static = engines
    prompt = torch.tensor(default_target.tokenizer("def fibonacci(n):\n    return")["input_ids"])
    tokens = torch.randint(0, dynamic.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    for k in (1, 3, 9, 17, 40, 70):
        outs = []
        for engine in (dynamic, static):
            engine.prefill(prompt, capacity=256)
            out = engine.forward(tokens[:k], taps=(5, 30))
            outs.append((out, engine.cache.k[:, :, :, : engine.length].clone(), engine.length))
        (a, ka, la), (b, kb, lb) = outs
        assert la == lb == len(prompt) + k
        assert torch.allclose(a.logits, b.logits, atol=2e-4, rtol=1e-4), k
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1)), k
        assert all(torch.allclose(a.hidden[t], b.hidden[t], atol=1e-4) for t in (5, 30))
        assert torch.allclose(ka, kb, atol=1e-4)
    assert {rows for rows, _ in static.static_passes.passes} == {1, 4, 16, 24, 48}  # 70 rows: past the buckets
    parents = [-1, 0, 0, 1, 1, 2, 3, -1, 7, 8]
    draft = Draft(tokens[1:11].tolist(), parents)
    logits = []
    for engine in (dynamic, static):
        engine.prefill(prompt, capacity=256)
        block, positions, mask = draft.verify_inputs(int(tokens[0]), engine.length)
        logits.append(engine.forward(block, positions, mask, logits_rows="all").logits)
    assert torch.allclose(logits[0], logits[1], atol=2e-4, rtol=1e-4)


def test_padding_rows_reach_no_real_row_and_graph_buffers_are_not_aliased(engines, default_target, one_thread):
    """NaN embeddings in padding rows change no real row; the outputs a pass returns are
    copies (a replayed graph reuses its output memory)."""
    _, static = engines
    prompt = torch.tensor(default_target.tokenizer("Hello there")["input_ids"])
    static.prefill(prompt, capacity=128)
    clean = static.forward(torch.tensor([5, 6, 7])).logits  # 3 rows in the 4-row bucket
    runner = static.static_passes.passes[(4, ())]
    original = static.embed
    try:
        static.embed = original.clone()
        static.embed[0] = float("nan")  # PAD_TOKEN's embedding
        static.crop(len(prompt))
        poisoned = static.forward(torch.tensor([5, 6, 7])).logits
    finally:
        static.embed = original
    assert torch.equal(clean, poisoned) and not poisoned.isnan().any()
    static.crop(len(prompt))
    again = static.forward(torch.tensor([8, 9, 10])).logits
    assert runner.bound_to(static) and not torch.equal(clean, again)
    assert not clean.isnan().any()  # clean still holds its own values


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("method", ["pld", "specinfer", "eagle3", "dflash", "ddtree"])
def test_methods_on_the_static_path_stay_exact(method, engines, default_target, one_thread):
    """Greedy fp32 decoding through static passes reproduces AR (the engine's one-token
    steps and verification both take the bucketed static path)."""
    from dataclasses import replace

    _, static = engines
    target = replace(default_target, engine=static)
    config = DecodeConfig(max_new_tokens=32, sampling=SamplingConfig(0.0), eos_token_ids=tuple(target.eos_token_ids))
    prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}])
    expected = registry.build_decoder("ar", default_target, {}).run_turn(prompt, config).tokens
    assert registry.build_decoder(method, target, {}).run_turn(prompt, config).tokens == expected
