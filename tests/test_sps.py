"""SpS: greedy output equals the AR baseline, draft KV rollback, drafter loading checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from sps_helpers import load_tiny_target, make_tiny_target_folder, noisy_draft, three_token_joint

from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.draft import Draft
from bench.core.drafters import MANIFEST, find_drafter, shipped_dirs
from bench.core.engine import Engine
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig, process_logits
from methods.sps import SpsDrafter, build, load_draft_engine

PROMPTS = [[1, 504, 3213, 28, 1790], [1, 77, 9, 4000, 12, 12, 12, 880, 301, 45, 2, 17]]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


def _greedy(max_new: int = 40) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=max_new, eos_token_ids=())


@pytest.mark.parametrize("gamma,schedule,noise", [
    (4, "constant", 0.0), (1, "constant", 0.1), (4, "constant", 0.1), (3, "heuristic", 0.1),
    (5, "constant", 0.3), (2, "heuristic", 3.0)])
def test_greedy_sps_equals_ar(tiny_target, gamma, schedule, noise):
    """Exact tokens whatever the draft's quality: identical, close, or unrelated weights."""
    draft = noisy_draft(tiny_target, noise)
    for prompt in PROMPTS:
        base = decode(tiny_target.engine, Drafter(), prompt, _greedy(30))
        result = decode(tiny_target.engine, SpsDrafter(draft, gamma, schedule), prompt, _greedy(30))
        assert result.tokens == base.tokens
        assert max(result.proposed_lengths) <= (gamma if schedule == "constant" else 16)
        if noise == 0.0:  # the target drafting for itself is always accepted
            assert result.accept_lengths == result.proposed_lengths


def test_mixed_acceptance_is_exercised(tiny_target):
    draft = noisy_draft(tiny_target, 0.1)
    result = decode(tiny_target.engine, SpsDrafter(draft, 4), PROMPTS[1], _greedy(40))
    accepted, proposed = sum(result.accept_lengths), sum(result.proposed_lengths)
    assert 0 < accepted < proposed  # both rollback paths (partial and full acceptance) ran


class _CheckedSps(SpsDrafter):
    """Checks after every round that the draft cache holds exactly the committed prefix."""

    def __init__(self, draft: Engine, reference: Engine, gamma: int) -> None:
        super().__init__(draft, gamma)
        self.reference = reference
        self.rounds = 0

    def learn(self, state, draft, verdict, out, rows) -> None:
        super().learn(state, draft, verdict, out, rows)
        self.rounds += 1
        assert self.draft.length == self.seen <= len(state.tokens) - 1
        self.reference.prefill(torch.tensor(state.tokens[: self.seen]), logits_rows="none")
        length = self.seen
        for got, want in ((self.draft.cache.k, self.reference.cache.k), (self.draft.cache.v, self.reference.cache.v)):
            assert torch.allclose(got[..., :length, :], want[..., :length, :], atol=1e-4)


def test_draft_kv_rollback_is_consistent(tiny_target):
    draft = noisy_draft(tiny_target, 0.1)
    reference = noisy_draft(tiny_target, 0.1)  # same seed: same weights, own cache
    drafter = _CheckedSps(draft, reference, gamma=3)
    result = decode(tiny_target.engine, drafter, PROMPTS[0], _greedy(40))
    assert drafter.rounds > 5 and len(result.tokens) == 40


def test_sampling_chain_carries_q(tiny_target):
    """At T > 0 each draft token is sampled from its recorded q row, and q is exactly the
    draft's distribution at that prefix after the target's warp (temperature, top-k, top-p)."""
    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9)
    cfg = DecodeConfig(max_new_tokens=30, sampling=sampling)
    drafter = SpsDrafter(noisy_draft(tiny_target, 0.3), 4)
    seen: list[tuple[list[int], Draft]] = []
    propose = drafter.propose

    def recording(state):
        draft = propose(state)
        seen.append((list(state.tokens), draft))
        return draft

    drafter.propose = recording
    result = decode(tiny_target.engine, drafter, PROMPTS[0], cfg, torch.Generator().manual_seed(0))
    assert len(result.tokens) == 30
    reference = noisy_draft(tiny_target, 0.3)  # same weights, fresh cache
    for context, draft in seen:
        if not len(draft):
            continue
        assert draft.q.shape == (len(draft), tiny_target.config.vocab_size)
        assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens))
        logits = reference.prefill(torch.tensor(context + draft.tokens[:-1]), logits_rows="all").logits
        expected = process_logits(logits[-len(draft):], sampling).softmax(-1)
        assert torch.allclose(draft.q, expected, atol=1e-5)


def test_sampling_is_reproducible_with_a_seed(tiny_target):
    cfg = DecodeConfig(max_new_tokens=25, sampling=SamplingConfig(temperature=1.0))
    runs = [decode(tiny_target.engine, SpsDrafter(noisy_draft(tiny_target, 0.3), 3), PROMPTS[1], cfg,
                   torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ drafters
def _manifest(target, **changes) -> dict:
    config = target.config.to_dict()
    config["num_hidden_layers"] = 1
    manifest = {"method": "sps", "architecture": config,
                "target": {"name": target.name, "fingerprint": target.fingerprint,
                           "vocab_size": target.config.vocab_size}}
    manifest["target"].update(changes)
    return manifest


def _write_drafter(folder, target, **changes) -> None:
    from bench.core.target import load_state_dict

    state = load_state_dict(target.path)
    layers = {k: v.to(torch.bfloat16) for k, v in state.items() if k.startswith("model.layers.0.")}
    layers["model.norm.weight"] = state["model.norm.weight"].to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(layers, str(folder / "model.safetensors"))
    (folder / MANIFEST).write_text(json.dumps(_manifest(target, **changes)))


def test_drafter_folder_adds_shared_weights(tiny_target, tmp_path):
    _write_drafter(tmp_path / "d", tiny_target)
    draft, info = load_draft_engine(tiny_target, tmp_path / "d")
    assert draft.embed is tiny_target.engine.embed  # shared, not copied
    assert draft.num_layers == 1 and info["draft_layers"] == 1
    decoder = build(tiny_target, {"drafter": str(tmp_path / "d"), "gamma": 2})
    base = decode(tiny_target.engine, Drafter(), PROMPTS[0], _greedy(20))
    assert decoder.run_turn(PROMPTS[0], _greedy(20)).tokens == base.tokens


def test_specinfer_records_the_sps_draft_it_loads(tiny_target, tmp_path):
    from methods.specinfer import build as build_specinfer

    _write_drafter(tmp_path / "d", tiny_target)
    sps = build(tiny_target, {"drafter": str(tmp_path / "d")})
    specinfer = build_specinfer(tiny_target, {"drafter": str(tmp_path / "d")})
    assert specinfer.info["drafter"] == sps.info["drafter"] == str(tmp_path / "d")
    assert specinfer.info["draft_layers"] == 1


def test_drafter_for_other_target_is_refused(tiny_target, tmp_path):
    _write_drafter(tmp_path / "d", tiny_target, fingerprint="0123456789abcdef")
    with pytest.raises(BenchError, match="trained for target"):
        load_draft_engine(tiny_target, tmp_path / "d")
    _write_drafter(tmp_path / "v", tiny_target, vocab_size=32000)
    with pytest.raises(BenchError, match="vocab"):
        load_draft_engine(tiny_target, tmp_path / "v")


def test_hf_folder_with_other_tokenizer_is_refused(tiny_target, tmp_path):
    from sps_helpers import tiny_config
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path / "other"
    vocab = {f"w{i}": i for i in range(tiny_target.config.vocab_size)}  # same size, other tokens
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))
    tokenizer.save_pretrained(folder)
    AutoModelForCausalLM.from_config(tiny_config(tiny_target.config.vocab_size, 1)).save_pretrained(folder)
    with pytest.raises(BenchError, match="different tokenizer"):
        load_draft_engine(tiny_target, folder)


def test_hf_folder_with_same_tokenizer_loads(tiny_target, tmp_path):
    from sps_helpers import tiny_config
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf-draft"
    AutoModelForCausalLM.from_config(tiny_config(tiny_target.config.vocab_size, 1)).save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    draft, info = load_draft_engine(tiny_target, folder)
    assert draft.num_layers == 1
    base = decode(tiny_target.engine, Drafter(), PROMPTS[1], _greedy(20))
    assert decode(tiny_target.engine, SpsDrafter(draft, 3), PROMPTS[1], _greedy(20)).tokens == base.tokens


def test_missing_drafter_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BenchError, match="no sps drafter for target 'nobody'") as info:
        find_drafter("nobody", "sps")
    assert "\n" not in str(info.value)
    with pytest.raises(BenchError, match="not a folder"):
        find_drafter("nobody", "sps", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchError, match="neither"):
        find_drafter("nobody", "sps", tmp_path / "empty")


def test_bad_options(tiny_target, tmp_path):
    _write_drafter(tmp_path / "d", tiny_target)
    with pytest.raises(BenchError, match="unknown sps option"):
        build(tiny_target, {"drafter": str(tmp_path / "d"), "gama": 3})
    with pytest.raises(BenchError, match="schedule"):
        build(tiny_target, {"drafter": str(tmp_path / "d"), "schedule": "fast"})
    with pytest.raises(BenchError, match="gamma"):
        build(tiny_target, {"drafter": str(tmp_path / "d"), "gamma": 0})


def test_cli_run_with_missing_drafter(tmp_path, tiny_task):
    from click.testing import CliRunner

    from bench.cli import main

    result = CliRunner().invoke(main, ["run", "--method", "sps", "--task", str(tiny_task), "--drafter",
                                       str(tmp_path / "nowhere"), "--results-dir", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "--drafter" in result.output and "not a folder" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_shipped_drafter_on_real_target(default_target):
    """The shipped SmolLM2 drafter reproduces the baseline and gets drafts accepted."""
    if not (shipped_dirs(default_target.name, "sps")[0] / MANIFEST).exists():
        pytest.skip("no shipped sps drafter")
    decoder = build(default_target, {"drafter": str(shipped_dirs(default_target.name, "sps")[0])})
    from bench.core.target import chat_prompt

    prompt = chat_prompt(default_target.tokenizer, [{"role": "user", "content": "Explain what a list is in Python."}])
    config = DecodeConfig(max_new_tokens=64, eos_token_ids=tuple(default_target.eos_token_ids))
    base = decode(default_target.engine, Drafter(), prompt, config)
    result = decoder.run_turn(prompt, config)
    assert result.tokens == base.tokens
    assert sum(result.accept_lengths) > 0


@pytest.mark.slow  # ~15-30 s on 2 cores
def test_sampled_sps_follows_the_target_distribution(tiny_target, one_thread):
    """Chi-square: the first three generated tokens of sampled SpS (T=1, top-k 3) are
    distributed as the target's p(a) p(b|a) p(c|ab). The draft differs from the target
    (about 30% of its tokens are accepted), so acceptance and residual sampling both run.
    Power (checked by hand): drafting the argmax while recording q, or recording q
    without the top-k cut, fails this test."""
    from test_lossless_stats import ALPHA, chi_square_pvalue

    cfg = SamplingConfig(temperature=1.0, top_k=3)
    prompt = PROMPTS[0]
    engine = tiny_target.engine
    index, joint = three_token_joint(engine, prompt, cfg)
    drafter = SpsDrafter(noisy_draft(tiny_target, 0.3), 2)  # accepts ~30% of drafts
    counts = torch.zeros(len(joint) + 1)  # last cell: outside the target's support
    generator = torch.Generator().manual_seed(0)
    config = DecodeConfig(max_new_tokens=4, sampling=cfg)  # room for 2-token chains after the first token
    for _ in range(1500):
        tokens = tuple(decode(engine, drafter, prompt, config, generator).tokens[:3])
        counts[index.get(tokens, len(joint))] += 1
    assert chi_square_pvalue(counts, torch.tensor(joint + [0.0])) > ALPHA


@pytest.mark.parametrize("gamma,noise", [(3, 0.1), (4, 0.3), (2, 0.0)])
def test_sps_rounds_replay_the_loop_from_one_teacher_forced_pass(tiny_target, gamma, noise):
    """methods/sps/rounds (bench rounds --method sps): a greedy chain's rounds follow from the draft's top-1 after each
    token of the finished turn (accepted drafts are the target's tokens)."""
    from bench.rounds import recorded_rounds
    from methods.sps.rounds import sequence_rounds, turn_rows

    draft = noisy_draft(tiny_target, noise)
    for prompt in PROMPTS:
        result = decode(tiny_target.engine, SpsDrafter(draft, gamma), prompt, _greedy(40))
        tokens = torch.tensor(prompt + result.tokens)
        mask, starts = turn_rows(len(prompt), len(tokens), result.stop_reason)
        counts, _, _ = sequence_rounds(draft, tokens, mask, gamma, starts)
        assert counts == recorded_rounds({"accept_lengths": result.accept_lengths})
        assert 0 < counts[1] < counts[0] * gamma or noise == 0.0
