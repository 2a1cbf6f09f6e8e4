"""Batched decoding (bench.core.batch, bench.core.decode.decode_batch): one target pass per
round verifies every live request's draft; continuous batching; per-request token-exactness."""

from __future__ import annotations

import pytest
import torch

import bench.registry as registry
from bench.core.decode import DecodeConfig
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from bench.core.target import chat_prompt

QUESTIONS = ["Write a Python function that checks whether a number is prime.", "Name three colors.",
             "Explain recursion to a child in two sentences.", "What is 17 times 23?"]
LOSSLESS = [name for name, info in registry.METHODS.items() if info.lossless and name != "hf"]


@pytest.fixture(scope="module")
def bf16_target():
    from bench.core.target import load_target

    return load_target(None, device="cpu", dtype="bfloat16")


def _ar_replies(target):
    """The greedy config, the QUESTIONS' prompts and batch-1 AR's replies to them."""
    config = DecodeConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), eos_token_ids=tuple(target.eos_token_ids))
    prompts = [chat_prompt(target.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    ar = registry.build_decoder("ar", target, {})
    return config, prompts, [ar.run_turn(p, config).tokens for p in prompts]


@pytest.fixture(scope="module")
def ar_replies(bf16_target):
    return _ar_replies(bf16_target)


@pytest.mark.parametrize("method", LOSSLESS)
def test_batched_greedy_replies_equal_batch1_ar(method, bf16_target, ar_replies, one_thread):
    """3 slots, 4 requests (the 4th takes the first freed slot): each request's reply is the
    batch-1 AR reply, bit for bit (the engine's batch-invariant bf16 path)."""
    config, prompts, expected = ar_replies
    decoder = registry.build_decoder(method, bf16_target, {})
    results = decoder.run_batch(prompts, config, batch_size=3)
    assert [r.tokens for r in results] == expected
    assert max(r.load for r in results) > 1 and results[3].queued > 0  # shared passes; the 4th waited
    assert all(len(r.accept_lengths) == len(r.tree_sizes) > 0 for r in results)


@pytest.fixture(scope="module")
def fp32_ar_replies(default_target):
    return _ar_replies(default_target)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("method", LOSSLESS)
def test_batched_fp32_greedy_replies_equal_batch1_ar_up_to_near_ties(method, default_target, fp32_ar_replies,
                                                                     one_thread):
    """fp32 (no invariant path): each request's reply is the batch-1 AR reply, or first
    differs where the target's logits for the two parting tokens are within NEAR_TIE_MARGIN (what a run's audit
    reports apart as float noise)."""
    from bench.run import NEAR_TIE_MARGIN, divergence_margin

    config, prompts, expected = fp32_ar_replies
    decoder = registry.build_decoder(method, default_target, {})
    for prompt, result, ar in zip(prompts, decoder.run_batch(prompts, config, batch_size=3), expected):
        if result.tokens != ar:
            first = next(i for i, (a, b) in enumerate(zip(result.tokens, ar)) if a != b)
            margin = divergence_margin(default_target, prompt, ar[:first], result.tokens[first], ar[first])
            assert margin < NEAR_TIE_MARGIN["float32"], method


def test_one_pass_over_ragged_blocks_equals_batch1_passes(bf16_target, one_thread):
    """TargetBatch.forward over slots of different lengths with a chain, a tree and a single
    token gives each row the bits of the engine's batch-1 pass; NaN in stale slots reaches
    no real row; per-slot compaction keeps the chosen rows."""
    from bench.core.batch import TargetBatch
    from bench.core.draft import Draft

    engine = bf16_target.engine
    prompts = [chat_prompt(bf16_target.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    tree = Draft([11, 12, 13, 14, 15], [-1, -1, 0, 1, 2]).verify_inputs(7, 0)
    chain = Draft.chain([21, 22, 23, 24, 25, 26, 27, 28, 29]).verify_inputs(9, 0)
    single = Draft.empty().verify_inputs(5, 0)
    blocks = [chain, tree, single]
    batch = TargetBatch(engine, 3, 256)
    for slot, prompt in enumerate(prompts):
        batch.start(slot, prompt, taps=(10,))
        batch.k[:, slot, :, len(prompt):] = float("nan")
        batch.v[:, slot, :, len(prompt):] = float("nan")
    outs = batch.forward([0, 1, 2], blocks, taps=(10,))
    for prompt, (tokens, positions, mask), out in zip(prompts, blocks, outs):
        engine.prefill(torch.tensor(prompt))
        alone = engine.forward(tokens, positions + len(prompt), mask, taps=(10,))
        assert torch.equal(out.logits, alone.logits) and torch.equal(out.hidden[10], alone.hidden[10])
    assert batch.lengths == [len(p) + len(b[0]) for p, b in zip(prompts, blocks)]
    batch.keep(1, len(prompts[1]), [0, 2, 4])  # root -> 11 -> 13
    assert batch.lengths[1] == len(prompts[1]) + 3
    after = batch.forward([1], [Draft.empty().verify_inputs(99, 0)])[0].logits
    engine.prefill(torch.tensor(prompts[1]))
    engine.forward(tree[0], tree[1] + len(prompts[1]), tree[2])
    engine.keep(len(prompts[1]), [0, 2, 4])
    assert torch.equal(after, engine.forward(torch.tensor([99])).logits)


def test_a_batch_the_memory_cannot_hold_is_a_clear_error(bf16_target):
    from bench.core.batch import TargetBatch

    with pytest.raises(BenchError, match="smaller --batch-size"):
        TargetBatch(bf16_target.engine, 10**7, 4096)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("method", ["ar", "pld", "specinfer", "eagle3", "dflash"])
def test_batched_sampling_draws_what_batch1_draws(method, bf16_target, one_thread):
    """At temperature 1 each request, with its own generator, samples exactly the tokens it
    samples decoding alone (its logits are the batch-1 bits), so the batched path inherits
    the verifier's distribution guarantee (tests/test_lossless_stats.py) request by request."""
    config = DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(1.0),
                          eos_token_ids=tuple(bf16_target.eos_token_ids))
    prompts = [chat_prompt(bf16_target.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    decoder = registry.build_decoder(method, bf16_target, {})

    def generators():
        return [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]

    alone = [decoder.run_turn(p, config, g).tokens for p, g in zip(prompts, generators())]
    batched = [r.tokens for r in decoder.run_batch(prompts, config, batch_size=3, generators=generators())]
    assert batched == alone


def test_bench_run_batch_size_records_exact_batched_turns(tiny_task, tmp_path, one_thread):
    """`bench run --batch-size 2`: both sides decode batched (two-turn conversations: turn 2
    after every turn 1), records carry batch size, load and queueing, every greedy turn
    matches the batched baseline; a method outside the shared loop is a one-line refusal."""
    import json

    from click.testing import CliRunner

    from bench.cli import main

    args = ["run", "--task", str(tiny_task), "--max-new-tokens", "8", "--dtype", "bfloat16", "--results-dir",
            str(tmp_path), "--batch-size", "2", "--tag", "b2"]
    result = CliRunner().invoke(main, [*args, "--method", "pld"])
    assert result.exit_code == 0, result.output
    for name in ("ar", "pld"):  # pld last: its turns are compared with the baseline's
        [path] = tmp_path.rglob(f"{name}-b2.jsonl")
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        header, turns = lines[0], [r for r in lines if r.get("kind", r.get("type")) != "header" and "turn" in r]
        assert header["settings"]["batch_size"] == 2
        assert sorted((t["question_id"], t["turn"]) for t in turns) == [("q1", 1), ("q1", 2), ("q2", 1)]
        assert all(t["batch_size"] == 2 and t["load"] >= 1 and t["queued"] >= 0 for t in turns)
    assert all(t["exact_match"] for t in turns)
    refused = CliRunner().invoke(main, [*args, "--method", "hf"])
    assert refused.exit_code == 2 and "cannot decode batched" in refused.output


@pytest.mark.slow  # the slow tier (make test-slow)
def test_load_figure_from_runs_at_two_batch_sizes(tiny_task, tmp_path, one_thread):
    from click.testing import CliRunner

    from bench.cli import main

    for size in (1, 2):
        result = CliRunner().invoke(main, ["run", "--method", "pld", "--task", str(tiny_task), "--max-new-tokens", "6",
                                           "--dtype", "bfloat16", "--results-dir", str(tmp_path / "r"),
                                           "--batch-size", str(size), "--tag", f"load{size}"])
        assert result.exit_code == 0, result.output
    report = CliRunner().invoke(main, ["report", "--results", str(tmp_path / "r"), "--tag", "load1", "--tag", "load2",
                                       "--out", str(tmp_path / "plots")])
    assert report.exit_code == 0, report.output
    assert (tmp_path / "plots" / "figures" / "load.png").exists()
    # The main report: another series' tables, the load sweep drawn beside them (--load-tag).
    result = CliRunner().invoke(main, ["run", "--method", "pld", "--task", str(tiny_task), "--max-new-tokens", "6",
                                       "--dtype", "bfloat16", "--results-dir", str(tmp_path / "r"), "--tag", "grid"])
    assert result.exit_code == 0, result.output
    main_report = CliRunner().invoke(main, ["report", "--results", str(tmp_path / "r"), "--tag", "grid",
                                            "--load-tag", "load1", "--load-tag", "load2", "--out",
                                            str(tmp_path / "main")])
    assert main_report.exit_code == 0, main_report.output
    html = (tmp_path / "main" / "report.html").read_text()
    assert (tmp_path / "main" / "figures" / "load.png").exists() and "load1" in html
    tables = (tmp_path / "main" / "tables" / "per_task.csv").read_text()
    assert "load1" not in tables and "grid" in tables


def test_batched_sampling_follows_the_target_distribution(default_target, one_thread):
    """Chi-square on the batched path itself (tests/test_lossless_stats.py's test, through
    decode_batch): a random 8-token target, PLD drafting from a repetitive prompt, 4,000
    requests at temperature 1 through 8 slots with continuous batching; the first two
    emitted tokens must follow the target's p(a) p(b | a). The same counts reject a
    slightly sharpened target (temperature 0.8), so the test can fail."""
    from pathlib import Path

    from test_engine import engine_for, tiny_model
    from test_lossless_stats import ALPHA, chi_square_pvalue

    from bench.core.target import Target

    model = tiny_model(seed=3, vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked, context-dependent distributions
    engine = engine_for(model)
    target = Target("toy", Path("."), "toy", engine, default_target.tokenizer, model.config)
    prompt, trials = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], 4000
    config = DecodeConfig(max_new_tokens=2, sampling=SamplingConfig(1.0), eos_token_ids=())
    decoder = registry.build_decoder("pld", target, {})
    generators = [torch.Generator().manual_seed(7_000 + i) for i in range(trials)]
    results = decoder.run_batch([prompt] * trials, config, batch_size=8, generators=generators)
    assert sum(r.accept_lengths[0] > 0 for r in results) > trials / 20  # drafts were verified, some accepted
    assert max(r.load for r in results) == 8
    counts = torch.zeros(8, 8)
    for r in results:
        counts[r.tokens[0], r.tokens[1]] += 1

    def joint(temperature: float) -> torch.Tensor:
        first = (engine.prefill(torch.tensor(prompt)).logits[-1] / temperature).softmax(-1)
        rows = [(engine.prefill(torch.tensor(prompt + [a])).logits[-1] / temperature).softmax(-1) for a in range(8)]
        return first[:, None] * torch.stack(rows)

    assert chi_square_pvalue(counts, joint(1.0)) > ALPHA
    assert chi_square_pvalue(counts.sum(1), joint(1.0).sum(1)) > ALPHA
    assert chi_square_pvalue(counts, joint(0.8)) < ALPHA


def test_the_cyclic_gc_is_paused_while_a_turn_decodes_and_restored_after(default_target, one_thread):
    """Decoding (batch 1 and batched) runs with Python's cyclic GC off, so no collection lands
    inside a timed round; the GC's state before the call comes back after it, also on error."""
    import gc

    from bench.core.decode import Drafter, decode, decode_batch

    seen = []

    class Watch(Drafter):
        def propose(self, state):
            seen.append(gc.isenabled())
            return super().propose(state)

        def fork(self):
            return Watch()

    prompt = chat_prompt(default_target.tokenizer, [{"role": "user", "content": "Hi"}])
    config = DecodeConfig(max_new_tokens=4, sampling=SamplingConfig(0.0))
    assert gc.isenabled()
    decode(default_target.engine, Watch(), prompt, config)
    decode_batch(default_target.engine, [Watch(), Watch()], [prompt, prompt], config)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        decode(default_target.engine, Watch(), prompt, config)
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError):
        decode(default_target.engine, Watch(), None, config)
    assert gc.isenabled()
