"""Every registered lossless method, built as `bench run` builds it (shipped drafters,
default options), reproduces the target's own greedy tokens: the test a new method runs.

    pytest -q tests/test_every_method.py -k mymethod
"""

from __future__ import annotations

import pytest

import bench.registry as registry
from bench.core.decode import DecodeConfig
from bench.core.sampling import SamplingConfig
from bench.core.target import chat_prompt

PROMPTS = ["Write a Python function that returns the square of a number, with a docstring."]
# `hf` is transformers' own loop, compared with ours in tests/test_ar_vs_hf.py.
LOSSLESS = [name for name, info in registry.METHODS.items() if info.lossless and name not in ("ar", "hf")]


def _greedy_baseline(target, max_new_tokens: int):
    """(config, prompts, AR's tokens for each prompt)."""
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0),
                          eos_token_ids=tuple(target.eos_token_ids))
    prompts = [chat_prompt(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    ar = registry.build_decoder("ar", target, {})
    return config, prompts, [ar.run_turn(p, config).tokens for p in prompts]


@pytest.fixture(scope="module")
def baseline(default_target):
    return _greedy_baseline(default_target, 32)


@pytest.mark.parametrize("method", LOSSLESS)
def test_greedy_output_equals_the_targets(method, default_target, baseline, one_thread):
    config, prompts, expected = baseline
    decoder = registry.build_decoder(method, default_target, {})  # every trained method ships a drafter
    for prompt, tokens in zip(prompts, expected):
        assert decoder.run_turn(prompt, config).tokens == tokens


@pytest.fixture(scope="module")
def bf16_target():
    from bench.core.target import load_target

    return load_target(None, device="cpu", dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_baseline(bf16_target):
    return _greedy_baseline(bf16_target, 48)


@pytest.mark.parametrize("method", LOSSLESS)
def test_bf16_greedy_output_equals_the_bf16_targets(method, bf16_target, bf16_baseline, one_thread):
    """The batch-invariant engine path (bench.core.engine, on in bf16): a k-token
    verification rounds as the one-token step, so bf16 decoding is token-exact too."""
    assert bf16_target.engine.invariant
    config, prompts, expected = bf16_baseline
    decoder = registry.build_decoder(method, bf16_target, {})
    for prompt, tokens in zip(prompts, expected):
        assert decoder.run_turn(prompt, config).tokens == tokens


@pytest.mark.parametrize("method", ["lookahead", "specinfer", "eagle3", "ddtree"])
def test_bucket_padded_bf16_decoding_is_exact_and_sizes_the_cache_once(method, bf16_target, bf16_baseline,
                                                                       one_thread, monkeypatch):
    """Verify passes padded to VERIFY_BUCKETS (chains, trees, Lookahead's extra branch):
    still token-exact; and the target's KV cache, sized at the prefill for the whole turn,
    never grows inside a round."""
    from bench.core.engine import VERIFY_BUCKETS, KVCache

    grown, reserve = [], KVCache.reserve

    def watched(cache, needed):
        if cache is bf16_target.engine.cache and needed > cache.capacity:
            grown.append(needed)
        reserve(cache, needed)

    monkeypatch.setattr(KVCache, "reserve", watched)
    monkeypatch.setattr(bf16_target.engine, "buckets", VERIFY_BUCKETS)
    config, prompts, expected = bf16_baseline
    decoder = registry.build_decoder(method, bf16_target, {})
    for prompt, tokens in zip(prompts, expected):
        assert decoder.run_turn(prompt, config).tokens == tokens
    assert not grown
