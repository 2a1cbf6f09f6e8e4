"""`bench run --method ar` reproduces transformers.generate's greedy tokens, per task suite."""

from __future__ import annotations

import pytest

from bench.core.decode import DecodeConfig, Drafter, decode
from bench.run import RunSettings, run


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _check_suite(task: str, limit: int, max_new_tokens: int, tmp_path, default_target) -> None:
    settings = RunSettings(method="hf", task=task, limit=limit, max_new_tokens=max_new_tokens,
                           results_dir=str(tmp_path), device="cpu", dtype="float32")  # exact vs HF: fp32
    summary = run(settings)
    from bench.records import read_records

    _, ours = read_records(summary["_paths"]["ar"])
    _, theirs = read_records(summary["_paths"]["hf"])
    theirs = {(t["question_id"], t["turn"]): t for t in theirs}
    assert len(ours) == len(theirs) > 0
    for turn in ours:
        ref = theirs[(turn["question_id"], turn["turn"])]
        if turn["prompt_hash"] != ref["prompt_hash"]:
            continue  # an earlier turn diverged (near tie), so this prompt differs
        divergence = _first_divergence(turn["tokens"], ref["tokens"])
        assert ref["exact_match"] is (divergence is None)  # the run's own check agrees
        if divergence is not None:
            pytest.fail(f"{task} {turn['question_id']} turn {turn['turn']}: AR differs from HF at {divergence}")


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("task", ["mtbench", "humaneval", "gsm8k", "specbench"])
def test_ar_equals_hf_generate(task, tmp_path, default_target):
    _check_suite(task, limit=1, max_new_tokens=16, tmp_path=tmp_path, default_target=default_target)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["mtbench", "humaneval", "gsm8k", "specbench"])
def test_ar_equals_hf_generate_long(task, tmp_path, default_target):
    _check_suite(task, limit=5, max_new_tokens=128, tmp_path=tmp_path, default_target=default_target)


def test_stop_rules(default_target):
    """EOS ends a turn (and is kept), max_new_tokens cuts it, stop strings stop it."""
    tokenizer = default_target.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say OK."}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    eos = tuple(default_target.eos_token_ids)
    full = decode(default_target.engine, Drafter(), prompt, DecodeConfig(64, eos_token_ids=eos),
                  tokenizer=tokenizer)
    assert full.stop_reason == "eos" and full.tokens[-1] in eos
    assert len(full.accept_lengths) == len(full.tokens) - 1  # one round per token after the first
    cut = decode(default_target.engine, Drafter(), prompt, DecodeConfig(2, eos_token_ids=eos),
                 tokenizer=tokenizer)
    assert cut.stop_reason == "length" and cut.tokens == full.tokens[:2]
    text = tokenizer.decode(full.tokens[:-1])
    stop = text.strip()[:2]
    stopped = decode(default_target.engine, Drafter(), prompt,
                     DecodeConfig(64, eos_token_ids=eos, stop_strings=(stop,)), tokenizer=tokenizer)
    assert stopped.stop_reason == "stop_string" and stop in tokenizer.decode(stopped.tokens)
    assert stopped.tokens == full.tokens[: len(stopped.tokens)]


def test_an_eos_accepted_past_max_new_tokens_is_not_kept():
    """A round may accept tokens past the budget; an EOS among them must not lengthen the
    turn (AR stops at max_new_tokens; found as a 65-token PLD reply against AR's 64)."""
    from bench.core.decode import _StopRule

    rule = _StopRule(DecodeConfig(4, eos_token_ids=(0,)), None)
    assert rule.cut([5, 6, 7, 8, 0, 9], new_from=2) == (4, "length")
    assert rule.cut([5, 6, 7, 0, 9, 9], new_from=2) == (4, "eos")
    assert rule.cut([5, 6, 0], new_from=0) == (3, "eos")
    assert rule.cut([5, 6], new_from=0) == (2, None)
